"""Self-distillation data for the EAGLE-3 draft.

The target answers the training prompts (``heterospec.train.prompts``) with its chat template
applied, in batches on CPU, and for every position of prompt + response we record

* ``features [R, 3*H]`` fp16: the hidden states *entering* decoder layers ``(2, L//2, L-3)``
  (HF ``output_hidden_states[2], [L//2], [L-3]``), concatenated low, mid, high;
* ``final_hidden [R, H]`` fp16: the final *normed* hidden state, so that the target's
  next-token logits can be recomputed exactly at train time with the (tied) lm_head, restricted to
  the draft vocabulary (much smaller than storing full or top-k logits).

A sequence of ``n`` tokens has ``R = n - 1`` rows (row ``p`` belongs to token ``p``; the last
token is never fed to the target). Row ``p``'s ``final_hidden`` gives the target's distribution
of token ``p + 1``.

Shards (``shard_00000.safetensors`` ...) hold a fixed slice of the deterministic prompt list, so
a run can be stopped and resumed: finished shards are skipped; every file is written to a
temporary name and renamed, so a killed run never leaves a half shard. ``manifest.json`` records
the target, taps and generation settings; a resumed run with different settings is refused.

Shard tensors: ``tokens`` int32 [N] (all sequences concatenated), ``seq_offsets`` int64 [S+1],
``prompt_lens`` int32 [S], ``row_offsets`` int64 [S+1] (``row_offsets[i] = seq_offsets[i] - i``),
``sampled`` uint8 [S] (1 = temperature sampling, 0 = greedy), ``finished`` uint8 [S]
(1 = ended with an EOS token), ``features``, ``final_hidden``, ``target_argmax`` int32 [R] (the
target's full-vocabulary greedy token after row p, recorded for rows >= prompt_len - 1, else -1;
used to mask positions whose greedy token is outside the draft vocabulary). String metadata ``prompt_ids``
(JSON list).

**Token-only shards** (``store_taps=False``, or ``pack_shards``) keep what costs generation time
and drop what a forward recomputes: ``tokens`` (uint16 when the vocabulary fits), the offsets,
``prompt_lens``, ``sampled``, ``finished``, and the target's argmax only where it differs from the
next token (``argmax_rows`` / ``argmax_ids``: on greedy rows it never does). About 2 bytes per
token instead of ~4.6 KB, so a data set of millions of tokens can live in git
(``data/distill-v2``) and survive the machine it was generated on; the trainer recomputes the
taps of such shards with one teacher-forced target forward per batch (``recompute_taps``).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "DistillConfig",
    "DistillShard",
    "Sequence_",
    "aux_layer_ids",
    "generate_with_taps",
    "write_shard",
    "read_shard",
    "list_shards",
    "run_distill",
    "default_distill_dir",
    "chat_ids",
    "resolve_device_dtype",
    "bench_generation",
    "recompute_taps",
    "pack_shards",
]

FP16_MAX = 65504.0


def default_distill_dir() -> Path:
    """``<cache>/distill-v2``: the issue-11 data (chat mix, disjointness check, 16K prompts);
    the shipped draft's data was generated into ``<cache>/distill`` (pass ``--data`` for it)."""
    from ..defaults import cache_root

    return cache_root() / "distill-v2"


def resolve_device_dtype(device: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """``auto`` device: CUDA when available, else CPU. ``auto`` dtype: bfloat16 on CUDA and on a
    CPU with native bf16 (``heterospec.engine.cpu_has_native_bf16``: AVX512-BF16 / AMX), else
    float32 (emulated bf16 is slower than fp32). The teacher's text only needs to be the target's
    at the precision the draft will serve, so bf16 generation is fine where bf16 is served."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dtype == "auto":
        if dev.type == "cuda":
            dt = torch.bfloat16
        else:
            from ..engine import cpu_has_native_bf16

            dt = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    else:
        dt = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
              "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
    return dev, dt


def aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3 taps: the inputs of decoder layers (2, L//2, L-3) = HF hidden_states indices."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class DistillConfig:
    out_dir: str
    num_prompts: int = 16000          # prompts.DISTILL_NUM_PROMPTS (>= 2.5M response tokens)
    shard_size: int = 64              # prompts per shard = generation batch
    max_new_tokens: int = 320
    max_prompt_tokens: int = 448
    sampled_fraction: float = 0.25    # share of prompts answered with temperature sampling
    temperature: float = 0.7
    seed: int = 0
    length_window: int = 8            # sort prompts by length within windows of this many shards
    max_shards: int | None = None     # stop after this many shards in this run (None = all)
    time_budget_s: float | None = None  # stop starting new shards after this much wall time
    threads: int = 1
    mix: dict | None = None           # prompt sources -> weight (None: prompts.DISTILL_MIX)
    disjoint: bool = True             # drop prompts overlapping a benchmark / calibration prompt
    allow_missing_references: bool = False  # skip (with a warning) reference sets not available
    device: str = "auto"              # auto: cuda if available, else cpu
    dtype: str = "auto"               # auto: bf16 on cuda / native-bf16 CPUs, else float32
    store_taps: bool = True           # False: token-only shards (the trainer recomputes taps)
    skip_answered: tuple = ()         # data dirs whose shards' prompts are answered already: left out

# settings that do not change the data (or only its precision, or what of it is stored) and
# may differ on resume
_RUN_ONLY = ("out_dir", "max_shards", "time_budget_s", "threads", "allow_missing_references",
             "device", "dtype", "store_taps")
TOKENS_ONLY_FORMAT = "heterospec-distill-v1-tokens"


@dataclass
class Sequence_:
    """One distilled sequence (what a shard holds per prompt)."""

    prompt_id: str
    tokens: torch.Tensor          # [n] int64
    prompt_len: int
    features: torch.Tensor | None      # [n-1, 3H] fp16 (None: token-only shard)
    final_hidden: torch.Tensor | None  # [n-1, H] fp16 (None: token-only shard)
    sampled: bool = False
    finished: bool = True
    target_argmax: torch.Tensor | None = None  # [n-1] int64, the target's greedy token per row
                                                # (-1 where not recorded: prompt rows < P-1)


class _Taps:
    """Forward hooks that keep only the 3 EAGLE-3 taps and the final normed hidden state."""

    def __init__(self, model, layer_ids: Sequence[int]):
        self.layer_ids = list(layer_ids)
        self.store: dict = {}
        self.handles = []
        inner = model.model
        for i in self.layer_ids:
            self.handles.append(inner.layers[i].register_forward_pre_hook(self._pre(i),
                                                                          with_kwargs=True))
        self.handles.append(inner.norm.register_forward_hook(self._post))

    def _pre(self, i):
        def hook(mod, args, kwargs):
            self.store[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _post(self, mod, args, out):
        self.store["final"] = out

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        feats = torch.cat([self.store[i] for i in self.layer_ids], dim=-1)
        return feats, self.store["final"]

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()  # not inference_mode: callers mask the results in place
def recompute_taps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   on_model_device: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Taps of recorded sequences by one teacher-forced forward: ``(features [B, S, 3H],
    final_hidden [B, S, H])`` in float32 on the CPU (``on_model_device``: where the model is, for
    a trainer on the same GPU: the CPU round trip of ~150 MB a batch is then not made), row
    ``p`` = token ``p`` as in a shard.

    ``input_ids`` [B, S] right-padded (``attention_mask`` 1 on real tokens). Rows of padding
    are zero. Row ``p`` only sees tokens ``<= p``, exactly as in generation; the values differ
    from generation-time taps by rounding only (one parallel pass instead of a KV cache)."""
    dev = next(model.parameters()).device
    taps = _Taps(model, aux_layer_ids(model.config.num_hidden_layers))
    try:
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        model(input_ids=input_ids.to(dev), attention_mask=mask.to(dev), use_cache=False,
              logits_to_keep=1)
        feats, final = taps.take()
    finally:
        taps.remove()
    out = dev if on_model_device else torch.device("cpu")
    keep = mask.to(out, torch.bool).unsqueeze(-1)
    return (feats.to(out, torch.float32).masked_fill_(~keep, 0.0),
            final.to(out, torch.float32).masked_fill_(~keep, 0.0))


def _to_fp16(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp_(-FP16_MAX, FP16_MAX).to(torch.float16)


@torch.inference_mode()
def generate_with_taps(model, prompts: list[list[int]], max_new_tokens: int,
                       eos_ids: Sequence[int], sampled: Sequence[bool] | None = None,
                       temperature: float = 0.7, generator: torch.Generator | None = None,
                       pad_id: int = 0, taps: bool = True) -> list[dict]:
    """Batched generation with a HF ``LlamaForCausalLM`` (KV cache, left padding), recording
    the EAGLE-3 taps and the final normed hidden state at every fed position.
    ``taps=False`` records tokens only (``features`` / ``final_hidden`` are None): no hooks and
    no per-step copies of the taps to the host, for token-only shards.

    Finished sequences are dropped from the batch (the KV cache is compacted), so the batch
    shrinks as answers end. Returns per prompt: ``tokens`` (prompt + response, int64),
    ``features`` / ``final_hidden`` (fp16, ``n - 1`` rows) and ``finished``.
    """
    from transformers import DynamicCache

    num_layers = model.config.num_hidden_layers
    dev = next(model.parameters()).device
    tap = _Taps(model, aux_layer_ids(num_layers)) if taps else None
    try:
        B = len(prompts)
        sampled = [False] * B if sampled is None else list(sampled)
        eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long)
        plen = torch.tensor([len(p) for p in prompts])
        P = int(plen.max())
        ids = torch.full((B, P), pad_id, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, P - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp_(min=0)
        ids, mask, pos, eos = ids.to(dev), mask.to(dev), pos.to(dev), eos.to(dev)
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        res_feats: list[list] = [[] for _ in range(B)]
        res_final: list[list] = [[] for _ in range(B)]
        if tap is not None:
            feats, final = tap.take()
            feats, final = _to_fp16(feats).cpu(), _to_fp16(final).cpu()
            for b, p in enumerate(prompts):
                res_feats[b].append(feats[b, P - len(p):])
                res_final[b].append(final[b, P - len(p):])
        gen = [[] for _ in range(B)]
        amax = [[] for _ in range(B)]  # target argmax at rows >= P-1 (free: logits exist there)
        finished = [False] * B
        active = torch.arange(B, device=dev)
        samp = torch.tensor(sampled, dtype=torch.bool, device=dev)
        next_pos = plen.clone().to(dev)
        logits = out.logits[:, -1].float()
        for step in range(max_new_tokens):
            tok = logits.argmax(-1)
            act = active.tolist()
            for b, t in zip(act, tok.tolist()):
                amax[b].append(t)
            rows = samp[active].nonzero().squeeze(-1)
            if rows.numel():
                # only the sampled rows (a quarter): a full-batch softmax moved to a CPU generator
                # cost more than the target's step on a GPU
                probs = torch.softmax(logits[rows] / temperature, dim=-1)
                if generator is not None and generator.device != probs.device:
                    probs = probs.to(generator.device)
                tok[rows] = torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(dev)
            done_now = torch.isin(tok, eos)
            for b, t, d in zip(act, tok.tolist(), done_now.tolist()):
                gen[b].append(t)
                if d:
                    finished[b] = True
            if step == max_new_tokens - 1:
                break
            keep = (~done_now).nonzero().squeeze(-1)
            if keep.numel() == 0:
                break
            if keep.numel() < active.numel():
                cache.batch_select_indices(keep)
                mask = mask[keep]
                tok = tok[keep]
                active = active[keep]
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
            pos_now = next_pos[active].unsqueeze(-1)
            out = model(input_ids=tok.unsqueeze(-1), attention_mask=mask, position_ids=pos_now,
                        past_key_values=cache, use_cache=True)
            next_pos[active] += 1
            if tap is not None:
                feats, final = tap.take()
                f16, h16 = _to_fp16(feats[:, 0]).cpu(), _to_fp16(final[:, 0]).cpu()
                for j, b in enumerate(active.tolist()):
                    res_feats[b].append(f16[j:j + 1])
                    res_final[b].append(h16[j:j + 1])
            logits = out.logits[:, -1].float()
    finally:
        if tap is not None:
            tap.remove()
    results = []
    for b, p in enumerate(prompts):
        toks = torch.tensor(list(p) + gen[b], dtype=torch.long)
        f = torch.cat(res_feats[b]) if tap is not None else None
        h = torch.cat(res_final[b]) if tap is not None else None
        assert f is None or f.shape[0] == toks.numel() - 1, (f.shape, toks.numel())
        am = torch.full((toks.numel() - 1,), -1, dtype=torch.long)
        am[len(p) - 1:] = torch.tensor(amax[b][:toks.numel() - len(p)], dtype=torch.long)
        results.append({"tokens": toks, "features": f, "final_hidden": h, "target_argmax": am,
                        "finished": finished[b], "prompt_len": len(p)})
    return results


# ----------------------------------------------------------------------------- shard I/O


def _argmax_rows(seqs: list[Sequence_]) -> torch.Tensor:
    """Every sequence's target argmax per row, concatenated (-1 where not recorded)."""
    return torch.cat([s.target_argmax if s.target_argmax is not None
                      else torch.full((s.tokens.numel() - 1,), -1, dtype=torch.long) for s in seqs])


def write_shard(path: str | os.PathLike, seqs: list[Sequence_], extra_meta: dict | None = None,
                taps: bool = True) -> None:
    """Write sequences to one safetensors shard, atomically (temp file + rename).
    ``taps=False`` writes a token-only shard (module docstring)."""
    path = Path(path)
    lens = torch.tensor([s.tokens.numel() for s in seqs], dtype=torch.int64)
    seq_offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    seq_offsets[1:] = lens.cumsum(0)
    row_offsets = seq_offsets - torch.arange(len(seqs) + 1)
    tokens = torch.cat([s.tokens for s in seqs]).long()
    tensors = {
        "seq_offsets": seq_offsets,
        "row_offsets": row_offsets,
        "prompt_lens": torch.tensor([s.prompt_len for s in seqs], dtype=torch.int32),
        "sampled": torch.tensor([int(s.sampled) for s in seqs], dtype=torch.uint8),
        "finished": torch.tensor([int(s.finished) for s in seqs], dtype=torch.uint8),
    }
    if taps:
        for s in seqs:
            if (s.features is None or s.final_hidden is None
                    or s.features.shape[0] != s.tokens.numel() - 1
                    or s.final_hidden.shape[0] != s.tokens.numel() - 1):
                raise ValueError(f"sequence {s.prompt_id}: taps must have len(tokens) - 1 rows "
                                 f"(write a token-only shard with taps=False)")
        tensors.update({
            "tokens": tokens.to(torch.int32),
            "features": torch.cat([s.features for s in seqs]).to(torch.float16).contiguous(),
            "final_hidden": torch.cat([s.final_hidden for s in seqs]).to(torch.float16).contiguous(),
            "target_argmax": _argmax_rows(seqs).to(torch.int32),
        })
        fmt = "heterospec-distill-v1"
    else:
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFF):
            tensors["tokens"] = tokens.to(torch.int32)
        else:
            tensors["tokens"] = tokens.to(torch.int32).to(torch.uint16)
        # the recorded argmax is the next token on every greedy row: keep only the exceptions
        amax = _argmax_rows(seqs)
        nxt = torch.cat([s.tokens[1:].long() for s in seqs])
        rows = ((amax >= 0) & (amax != nxt)).nonzero().squeeze(-1)
        tensors["argmax_rows"] = rows.to(torch.int32)
        tensors["argmax_ids"] = amax[rows].to(torch.int32)
        fmt = TOKENS_ONLY_FORMAT
    meta = {"prompt_ids": json.dumps([s.prompt_id for s in seqs]), "format": fmt}
    meta.update({k: str(v) for k, v in (extra_meta or {}).items()})
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


class DistillShard:
    """Lazy reader of one shard (memory-mapped by safetensors)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with safe_open(str(self.path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            self.tokens = f.get_tensor("tokens").to(torch.int32).long()
            self.seq_offsets = f.get_tensor("seq_offsets")
            self.row_offsets = f.get_tensor("row_offsets")
            self.prompt_lens = f.get_tensor("prompt_lens").long()
            self.sampled = f.get_tensor("sampled").bool()
            self.finished = f.get_tensor("finished").bool()
            self.has_taps = "features" in keys
            self.features = f.get_tensor("features") if self.has_taps else None
            self.final_hidden = f.get_tensor("final_hidden") if self.has_taps else None
            if "target_argmax" in keys:
                self.target_argmax = f.get_tensor("target_argmax").long()
            elif "argmax_rows" in keys:
                self.target_argmax = self._argmax_from_exceptions(
                    f.get_tensor("argmax_rows").long(), f.get_tensor("argmax_ids").long())
            else:
                self.target_argmax = None
        self.prompt_ids = json.loads(meta.get("prompt_ids", "[]"))

    def _argmax_from_exceptions(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """A token-only shard's argmax per row: the next token from row ``prompt_len - 1`` on,
        -1 on earlier prompt rows, then the recorded exceptions."""
        S = len(self)
        lens = self.seq_offsets[1:] - self.seq_offsets[:-1]
        seq_of_row = torch.repeat_interleave(torch.arange(S), lens - 1)
        row_in_seq = torch.arange(int(self.row_offsets[-1])) - self.row_offsets[:-1][seq_of_row]
        nxt = self.tokens[self.seq_offsets[:-1][seq_of_row] + row_in_seq + 1]
        amax = torch.where(row_in_seq >= self.prompt_lens[seq_of_row] - 1, nxt, -1)
        amax[rows] = ids
        return amax

    def __len__(self) -> int:
        return self.prompt_lens.numel()

    def sequence(self, i: int) -> Sequence_:
        a, b = int(self.seq_offsets[i]), int(self.seq_offsets[i + 1])
        ra, rb = int(self.row_offsets[i]), int(self.row_offsets[i + 1])
        return Sequence_(prompt_id=self.prompt_ids[i] if self.prompt_ids else str(i),
                         tokens=self.tokens[a:b], prompt_len=int(self.prompt_lens[i]),
                         features=None if self.features is None else self.features[ra:rb],
                         final_hidden=None if self.final_hidden is None else self.final_hidden[ra:rb],
                         sampled=bool(self.sampled[i]), finished=bool(self.finished[i]),
                         target_argmax=(None if self.target_argmax is None
                                        else self.target_argmax[ra:rb]))

    def __iter__(self) -> Iterator[Sequence_]:
        for i in range(len(self)):
            yield self.sequence(i)

    @property
    def num_response_tokens(self) -> int:
        lens = self.seq_offsets[1:] - self.seq_offsets[:-1]
        return int((lens - self.prompt_lens).sum())


def read_shard(path) -> list[Sequence_]:
    return list(DistillShard(path))


def list_shards(data_dir: str | os.PathLike) -> list[Path]:
    return sorted(Path(data_dir).glob("shard_*.safetensors"))


# ----------------------------------------------------------------------------- driver


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of one user turn with the chat template and the assistant header applied."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _shard_plan(prompts, tokenizer, cfg: DistillConfig) -> list[list[tuple[object, list[int]]]]:
    """Tokenize (chat template), drop over-long prompts, sort by length within windows of
    ``length_window`` shards (less padding), and cut into shards. Deterministic."""
    enc = []
    for p in prompts:
        ids = chat_ids(tokenizer, p.text)
        if len(ids) <= cfg.max_prompt_tokens:
            enc.append((p, ids))
    window = cfg.shard_size * cfg.length_window
    shards = []
    for w in range(0, len(enc), window):
        chunk = sorted(enc[w:w + window], key=lambda e: len(e[1]))
        for s in range(0, len(chunk), cfg.shard_size):
            shards.append(chunk[s:s + cfg.shard_size])
    return shards


def _eos_ids(tokenizer, model) -> list[int]:
    ids = set()
    gc = getattr(model, "generation_config", None)
    for src in (getattr(gc, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                tokenizer.eos_token_id):
        if src is None:
            continue
        ids.update(src if isinstance(src, (list, tuple)) else [src])
    for t in ("<|im_end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(t)
        if isinstance(tid, int) and tid >= 0 and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(ids)


def _check_or_write_manifest(out: Path, manifest: dict) -> None:
    """Write ``out/manifest.json``, or refuse when one exists for other data (a resumed run, or
    shards packed into a directory, must continue the same prompt list and settings)."""
    mpath = out / "manifest.json"
    if mpath.exists():
        old = json.loads(mpath.read_text())
        keys = ["num_layers", "hidden_size", "vocab_size", "aux_layers", "config"]
        if "prompt_list_sha256" in old:  # the prompt list (after the disjointness check) is fixed
            keys.append("prompt_list_sha256")
        for k in keys:
            if old.get(k) != manifest.get(k):
                raise ValueError(f"{mpath} was written with a different {k} ({old.get(k)!r} vs "
                                 f"{manifest.get(k)!r}); use another --out or the same settings")
    else:
        tmp = mpath.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, mpath)


def pack_shards(src_dir, dst_dir, log=print) -> dict:
    """Token-only copies of ``src_dir``'s shards in ``dst_dir`` (e.g. ``data/distill-v2`` in
    git), with its manifest and disjointness report. Shards already in ``dst_dir`` are kept; a
    ``dst_dir`` holding another prompt list or other settings is refused. Returns a summary."""
    from tqdm import tqdm

    src, dst = Path(src_dir), Path(dst_dir)
    mpath = src / "manifest.json"
    if not mpath.exists():
        raise FileNotFoundError(f"{src}: no manifest.json (not a distillation directory)")
    dst.mkdir(parents=True, exist_ok=True)
    _check_or_write_manifest(dst, json.loads(mpath.read_text()))
    if (src / "disjointness.json").exists() and not (dst / "disjointness.json").exists():
        (dst / "disjointness.json").write_text((src / "disjointness.json").read_text())
    todo = [p for p in list_shards(src) if not (dst / p.name).exists()]
    resp = 0
    for path in tqdm(todo, desc="pack", unit="shard", mininterval=5):
        shard = DistillShard(path)
        with safe_open(str(path), framework="pt") as f:
            extra = {k: v for k, v in (f.metadata() or {}).items() if k not in ("prompt_ids", "format")}
        write_shard(dst / path.name, list(shard), extra_meta=extra, taps=False)
        resp += shard.num_response_tokens
    log(f"packed {len(todo)} shards ({resp} response tokens) into {dst}; "
        f"{len(list_shards(dst))} there now")
    return {"packed": len(todo), "response_tokens": resp, "shards": len(list_shards(dst))}


def run_distill(cfg: DistillConfig, model=None, tokenizer=None, prompts=None,
                target_dir: str | None = None, log=print) -> dict:
    """Generate (or resume) the distillation shards described by ``cfg``.

    ``model``/``tokenizer`` default to the built-in target (``heterospec.defaults``), loaded
    on ``cfg.device`` in ``cfg.dtype`` (see ``resolve_device_dtype``); ``prompts`` to
    ``build_training_prompts(cfg.num_prompts, cfg.seed, cfg.mix or DISTILL_MIX)``. With
    ``cfg.disjoint`` (default) the prompts first pass ``heterospec.train.disjoint`` against the
    five benchmark sets and the calibration split; the report goes to ``DATA/disjointness.json``
    and the manifest. Returns a summary dict.
    """
    from tqdm import tqdm

    torch.set_num_threads(max(1, cfg.threads))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if model is None or tokenizer is None:
        from transformers import AutoTokenizer, LlamaForCausalLM

        if target_dir is None:
            from ..defaults import default_target_dir

            target_dir = str(default_target_dir())
        dev, dt = resolve_device_dtype(cfg.device, cfg.dtype)
        log(f"loading target from {target_dir} on {dev} in {dt}")
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        model = LlamaForCausalLM.from_pretrained(target_dir, dtype=dt).to(dev)
    model.eval()
    gen_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    prompt_info = None
    if prompts is None:
        from .prompts import DISTILL_MIX, build_training_prompts, source_info

        mix = dict(cfg.mix or DISTILL_MIX)
        # template fills that differ from a calibration prompt only in names / numbers are
        # dropped as near duplicates (~13% of a templated list against 64 calibration prompts):
        # draw extra candidates and keep the first num_prompts that pass
        n_cand = int(cfg.num_prompts * 1.5) if cfg.disjoint else cfg.num_prompts
        prompts = build_training_prompts(n_cand, cfg.seed, mix=mix)
        prompt_info = {"sources": source_info(mix), "mix": mix}
    if cfg.disjoint:
        from .disjoint import filter_prompts, reference_sets

        index = reference_sets(allow_missing=cfg.allow_missing_references, log=log)
        prompts, report = filter_prompts(prompts, index)
        prompts = prompts[:cfg.num_prompts]
        report["used"] = len(prompts)
        log(f"disjointness: {report['dropped']} of {report['candidates']} prompts dropped "
            f"(per set: {report['dropped_per_set']})")
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "disjointness.json.tmp"
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, out / "disjointness.json")
        prompt_info = dict(prompt_info or {}, disjointness=report)
    if cfg.skip_answered:
        # prompts another set answered already (e.g. a plan begun on another host whose Python
        # builds other code prompts, so that it cannot be resumed here): not answered twice
        answered = set()
        for d in cfg.skip_answered:
            shards = list_shards(d)
            if not shards:
                raise ValueError(f"skip-answered: no distilled shards (shard_*.safetensors) in {d}")
            answered.update(pid for f in shards for pid in DistillShard(f).prompt_ids)
        before = len(prompts)
        prompts = [p for p in prompts if p.id not in answered]
        log(f"skip-answered: {before - len(prompts)} prompts answered in {', '.join(map(str, cfg.skip_answered))}")
    counts: dict = {}
    for p in prompts:
        src = getattr(p, "source", "?").split(":")[0]
        counts[src] = counts.get(src, 0) + 1
    prompt_info = dict(prompt_info or {}, counts=counts)
    import hashlib

    list_sha = hashlib.sha256("\n".join(f"{p.id}\t{p.text}" for p in prompts).encode()).hexdigest()
    L = model.config.num_hidden_layers
    manifest = {
        "format": "heterospec-distill-v1",
        "target": str(target_dir) if target_dir else getattr(model.config, "_name_or_path", ""),
        "num_layers": L, "hidden_size": model.config.hidden_size,
        "vocab_size": model.config.vocab_size, "aux_layers": list(aux_layer_ids(L)),
        # as JSON holds it (a resumed run compares it with the file); skip_answered only when set,
        # so manifests written before it existed still match
        "config": json.loads(json.dumps({k: v for k, v in asdict(cfg).items() if k not in _RUN_ONLY
                                         and not (k == "skip_answered" and not v)})),
        "prompt_list_sha256": list_sha, "prompts": prompt_info, "generation_dtype": gen_dtype,
    }
    _check_or_write_manifest(out, manifest)

    plan = _shard_plan(prompts, tokenizer, cfg)
    eos = _eos_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    todo = [i for i in range(len(plan)) if not (out / f"shard_{i:05d}.safetensors").exists()]
    if cfg.max_shards is not None:
        todo = todo[:cfg.max_shards]
    log(f"{len(plan)} shards planned ({sum(map(len, plan))} prompts), {len(plan) - len(todo)} "
        f"already done or skipped, {len(todo)} to generate; eos ids {eos}")
    t0 = time.time()
    n_tok = n_resp = 0
    bar = tqdm(todo, desc="distill", unit="shard", mininterval=10, dynamic_ncols=True)
    for i in bar:
        if cfg.time_budget_s is not None and time.time() - t0 > cfg.time_budget_s:
            log(f"time budget reached; stopping before shard {i}")
            break
        items = plan[i]
        # on the target's device: a CUDA run draws other samples than a CPU run (both seeded)
        gen = torch.Generator(device=next(model.parameters()).device).manual_seed(cfg.seed * 1_000_003 + i)
        rng = random.Random(f"distill-{cfg.seed}-{i}")
        sampled = [rng.random() < cfg.sampled_fraction for _ in items]
        ts = time.time()
        res = generate_with_taps(model, [ids for _, ids in items], cfg.max_new_tokens, eos,
                                 sampled=sampled, temperature=cfg.temperature, generator=gen,
                                 pad_id=pad, taps=cfg.store_taps)
        seqs = [Sequence_(prompt_id=p.id, tokens=r["tokens"], prompt_len=r["prompt_len"],
                          features=r["features"], final_hidden=r["final_hidden"], sampled=s,
                          finished=r["finished"], target_argmax=r["target_argmax"])
                for (p, _), r, s in zip(items, res, sampled)]
        write_shard(out / f"shard_{i:05d}.safetensors", seqs, extra_meta={"dtype": gen_dtype},
                    taps=cfg.store_taps)
        dt = time.time() - ts
        tok = sum(int(s.tokens.numel()) for s in seqs)
        resp = sum(int(s.tokens.numel()) - s.prompt_len for s in seqs)
        n_tok += tok
        n_resp += resp
        el = time.time() - t0
        bar.set_postfix(tok_s=f"{n_tok / el:.0f}", resp_tok_s=f"{n_resp / el:.0f}",
                        resp_tok=n_resp)
        log(f"shard {i}: {len(seqs)} seqs, {tok} tokens ({resp} response) in {dt:.0f}s "
            f"= {tok / dt:.0f} tok/s; run total {n_resp} response tokens, "
            f"{n_tok / el:.0f} tok/s overall")
    bar.close()
    done = list_shards(out)
    return {"shards": len(done), "planned": len(plan), "tokens_this_run": n_tok,
            "response_tokens_this_run": n_resp, "seconds": time.time() - t0}


def bench_generation(num_prompts: int = 64, batch: int = 32, max_new_tokens: int = 128,
                     time_budget_s: float = 60.0, device: str = "auto", dtype: str = "auto",
                     threads: int = 1, target_dir: str | None = None, seed: int = 0,
                     log=print) -> dict:
    """Distillation speed: the target answers training prompts in batches of ``batch`` (greedy,
    taps recorded exactly as ``run_distill`` does, nothing written) until ``num_prompts`` are
    done or ``time_budget_s`` has passed (checked between batches; the first batch always
    runs). Model loading and prompt building are not timed. Returns response tokens/s and
    the setting."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from .prompts import DEFAULT_MIX, build_training_prompts

    torch.set_num_threads(max(1, threads))
    if target_dir is None:
        from ..defaults import default_target_dir

        target_dir = str(default_target_dir())
    dev, dt = resolve_device_dtype(device, dtype)
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=dt).to(dev).eval()
    # sources that need no download (instruct / math), in the distillation order
    prompts = build_training_prompts(num_prompts, seed=seed, mix={"instruct": 0.7, "math": 0.3})
    enc = [chat_ids(tok, p.text) for p in prompts]
    eos = _eos_ids(tok, model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    n_resp = n_tok = n_prompts = 0
    t0 = time.time()
    for i in range(0, len(enc), batch):
        if i and time.time() - t0 > time_budget_s:
            break
        chunk = sorted(enc[i:i + batch], key=len)
        res = generate_with_taps(model, chunk, max_new_tokens, eos, pad_id=pad)
        n_prompts += len(res)
        n_resp += sum(int(r["tokens"].numel()) - r["prompt_len"] for r in res)
        n_tok += sum(int(r["tokens"].numel()) for r in res)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        el = time.time() - t0
        log(f"{n_prompts} prompts, {n_resp} response tokens in {el:.1f}s = {n_resp / el:.1f} resp tok/s")
    el = time.time() - t0
    return {"response_tokens_per_s": n_resp / el, "tokens_per_s": n_tok / el,
            "response_tokens": n_resp, "prompts": n_prompts, "seconds": el, "batch": batch,
            "max_new_tokens": max_new_tokens, "device": str(dev),
            "dtype": str(dt).removeprefix("torch."), "threads": torch.get_num_threads()}
