"""Loading heterospec's C++/CUDA ops (``torch.ops.heterospec.*``), and the build settings shared with setup.py.

Two ways the ops get compiled against the torch they run with:

* **ahead of time** (``pip install --no-build-isolation .``, torch visible to the build): setup.py
  compiles ``heterospec._C`` and importing heterospec imports it;
* **on first import** (a plain ``pip install .``: pip's isolated build cannot see torch, so setup.py
  builds a pure-Python package that carries the sources in ``heterospec/_csrc``): ``ensure_ops()``
  compiles them with ``torch.utils.cpp_extension.load`` (ninja) into
  ``<cache>/ops/<torch version, C++ ABI, Python, CPU/CUDA, source hash>/`` and loads that library;
  later imports load it directly (no compiler run). A prebuilt ``_C`` that no longer loads (torch
  changed under it) falls back to this path too, with a message.

``HETEROSPEC_JIT=1`` forces the on-first-import build even when a prebuilt ``_C`` exists.
``HETEROSPEC_FORCE_CPU=1`` builds only the CPU kernels. ``MAX_JOBS`` caps parallel compile jobs.

setup.py loads this file by path (it must not import torch or heterospec at module level).
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from typing import Callable, List, Optional

#: How the ops were loaded in this process: "prebuilt" (heterospec._C), "jit" (compiled on first
#: import or loaded from the cache) or None before ensure_ops().
LOADED: Optional[str] = None
#: The shared library that registered the ops (a path), once loaded.
LIBRARY: Optional[str] = None

JIT_ENV = "HETEROSPEC_JIT"
FORCE_CPU_ENV = "HETEROSPEC_FORCE_CPU"
JIT_NAME = "heterospec_ops"
_BUILD_MARKER = "heterospec-build.json"
_HERE = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------- build settings (shared)

def cpu_sources(csrc: str) -> List[str]:
    return sorted(glob.glob(os.path.join(csrc, "*.cpp")) + glob.glob(os.path.join(csrc, "cpu", "*.cpp")))


def cuda_sources(csrc: str) -> List[str]:
    return sorted(glob.glob(os.path.join(csrc, "cuda", "*.cu")))


def source_files(csrc: str) -> List[str]:
    """Every file of the C++/CUDA sources (for the wheel's copy and the cache key)."""
    out = []
    for dirpath, _, files in os.walk(csrc):
        out += [os.path.join(dirpath, f) for f in files if f.endswith((".cpp", ".h", ".cu", ".cuh"))]
    return sorted(out)


def cxx_flags(openmp: bool) -> List[str]:
    # -fno-trapping-math: we never read FP exception flags, and it lets GCC turn the selects of the
    # portable topk_entropy loop into vector blends (4x on that path; results unchanged).
    return ["-O3", "-g0", "-fno-trapping-math"] + (["-fopenmp"] if openmp else [])


def nvcc_flags() -> List[str]:
    return ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]


def link_flags(openmp: List[str]) -> List[str]:
    """Linker flags of every build: OpenMP, and libstdc++ as a shared library.

    A compiler that links libstdc++ statically (a wrapper adding ``-static-libstdc++``, as on the
    GPU host's ``/opt/gcc/bin/g++``) gives ``_C`` its own copy of the C++ runtime: every C++
    exception our ops throw (each ValueError of a bad input) then unwinds through two runtimes and
    the process dies with SIGSEGV instead of raising. Naming the shared library here, before the
    driver appends its static one, resolves those symbols from ``libstdc++.so`` (the archive is
    then never pulled in). The library is named by the path of the runtime this process (torch)
    has loaded: ``-lstdc++`` is not enough where the compiler's own library folder holds only
    ``libstdc++.a`` (the GPU host, 26 Nov: ld takes the first folder with either file). GNU ld / lld
    on Linux only."""
    if not sys.platform.startswith("linux"):
        return list(openmp)
    runtime = shared_cxx_runtime()
    lib = runtime if runtime and "," not in runtime else "-Bdynamic,-lstdc++"
    return list(openmp) + [f"-Wl,--push-state,--no-as-needed,{lib},--pop-state"]


def shared_cxx_runtime() -> Optional[str]:
    """The shared libstdc++ mapped into this process (torch loads it), or None (not Linux, not loaded)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith("libstdc++.so"):
                    path = parts[5].strip()
                    if os.path.isfile(path):
                        return path
    except OSError:
        return None
    return None


def needed_libraries(path: str) -> Optional[List[str]]:
    """The DT_NEEDED entries of a shared library (``readelf -d``), or None when they cannot be read."""
    readelf = shutil.which("readelf")
    if readelf is None or not os.path.isfile(path):
        return None
    try:
        out = subprocess.run([readelf, "-d", path], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def check_shared_cxx_runtime(path: str) -> None:
    """Refuse a built library without a shared libstdc++ (see link_flags): its first C++ exception
    would kill the process. No-op off Linux or without readelf."""
    needed = needed_libraries(path) if sys.platform.startswith("linux") else None
    if needed is None or any(n.startswith("libstdc++") for n in needed):
        return
    raise RuntimeError(
        f"{path} was linked without the shared libstdc++ (NEEDED: {', '.join(needed) or 'none'}): the C++ "
        f"compiler ({os.environ.get('CXX', 'c++')}) links it statically, so every error our ops raise would "
        f"crash the process (SIGSEGV) instead of raising ValueError. Build with another compiler "
        f"(e.g. CXX=/usr/bin/g++) or one whose linker accepts -Wl,--push-state.")


def openmp_flags(torch) -> List[str]:
    """-fopenmp when torch uses OpenMP: at::parallel_for is inline, so with torch's OpenMP backend it
    is a `#pragma omp parallel` in our own code, and without -fopenmp every CPU kernel silently runs on
    one thread. The library resolves (by soname) to the libgomp torch already loaded."""
    if sys.platform == "darwin" or not torch.backends.openmp.is_available():
        return []
    return ["-fopenmp"]


def pin_cuda_home(log: Callable[[str], None] = print) -> None:
    """Set CUDA_HOME to the toolkit the `nvcc` on PATH really runs from, when torch would guess wrong.

    With neither CUDA_HOME nor CUDA_PATH set, torch.utils.cpp_extension (at import) takes the parent
    of the nvcc on PATH. If that nvcc is a wrapper script or symlink outside the toolkit (e.g.
    /usr/local/bin/nvcc running /usr/local/cuda-13.0/bin/nvcc), the guess (/usr/local) has no CUDA
    headers or libcudart: the .cu files still compile, but the link fails with `cannot find -lcudart`.
    Call before torch.utils.cpp_extension is imported (it fixes CUDA_HOME at import time).
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return  # torch falls back to /usr/local/cuda by itself

    def is_toolkit(home: str) -> bool:
        return os.path.isfile(os.path.join(home, "include", "cuda_runtime.h"))

    if is_toolkit(os.path.dirname(os.path.dirname(nvcc))):
        return  # torch's guess is right
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    try:  # nvcc reports its own install dir ("#$ TOP=/usr/local/cuda-13.0/bin/..") in a dry run
        out = subprocess.run([nvcc, "-dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             check=False, capture_output=True, text=True, timeout=60)
        tops = re.findall(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
        candidates += [os.path.realpath(top) for top in tops]
    except (OSError, subprocess.SubprocessError):
        pass
    for home in candidates:
        if is_toolkit(home):
            log(f"heterospec: CUDA_HOME={home} (the toolkit behind {nvcc})")
            os.environ["CUDA_HOME"] = home
            return


# --------------------------------------------------------------------------- progress

class CompileProgress:
    """Reports, from a background thread, how many object files a build has written so far.

    ``root``: the directory the compiler writes ``*.o`` files into (searched recursively); only
    files written after start count. ``out``: callables that take one line.
    """

    def __init__(self, root: str, total: int, out: List[Callable[[str], None]], every_s: float = 30.0):
        self.root, self.total, self.out, self.every_s = root, total, out, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.time()

    def _done(self) -> int:
        n = 0
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                if f.endswith(".o"):
                    try:
                        if os.path.getmtime(os.path.join(dirpath, f)) >= self.t0 - 1:
                            n += 1
                    except OSError:
                        pass
        return n

    def say(self, line: str) -> None:
        for o in self.out:
            try:
                o(line)
            except (OSError, ValueError):
                pass

    def _run(self) -> None:
        last, last_t = 0, self.t0
        while not self._stop.wait(2.0):
            n, now = self._done(), time.time()
            if n != last or now - last_t >= self.every_s:
                self.say(f"heterospec: compiling the C++ ops: {min(n, self.total)}/{self.total} sources done "
                         f"({now - self.t0:.0f} s)")
                last, last_t = n, now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)
        return False


def stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- loading

def csrc_dir() -> Optional[str]:
    """The C++ sources: ``heterospec/_csrc`` in an installed wheel, ``<repo>/csrc`` in a checkout."""
    for d in (os.path.join(_HERE, "_csrc"), os.path.join(os.path.dirname(_HERE), "csrc")):
        if os.path.isfile(os.path.join(d, "ops.cpp")):
            return d
    return None


def _want_cuda(torch) -> bool:
    return torch.version.cuda is not None and os.environ.get(FORCE_CPU_ENV, "0") != "1"


def _cache_dir(torch, csrc: str, with_cuda: bool, flags: List[str]) -> str:
    from .fetch import cache_root

    h = hashlib.sha256()
    for f in source_files(csrc):
        h.update(os.path.relpath(f, csrc).encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(fh.read())
    h.update(json.dumps(flags).encode())
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 0))
    variant = f"cuda{torch.version.cuda}" if with_cuda else "cpu"
    key = (f"torch{torch.__version__}-cxx11abi{abi}-py{sys.version_info[0]}{sys.version_info[1]}-"
           f"{platform.machine()}-{variant}-{h.hexdigest()[:12]}")
    return os.path.join(str(cache_root()), "ops", key)


def _find_ninja() -> bool:
    if shutil.which("ninja"):
        return True
    # the `ninja` wheel (a heterospec dependency) puts its binary next to this interpreter's
    # scripts, which are not on PATH when the environment is not activated
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # type: ignore

        dirs.insert(0, getattr(ninja, "BIN_DIR", ""))
    except ImportError:
        pass
    for d in dirs:
        if d and os.path.isfile(os.path.join(d, "ninja")):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return True
    return False


def _jit_error(msg: str) -> ImportError:
    return ImportError(f"heterospec: cannot compile the C++ ops for this torch: {msg}")


def _jit(reason: str) -> str:
    """Compile (once per torch / ABI / source version) or load the cached ops library; returns its path."""
    import torch

    csrc = csrc_dir()
    if csrc is None:
        raise _jit_error(f"{reason}, and the C++ sources are not shipped with this copy of heterospec "
                         f"(no heterospec/_csrc); reinstall it (pip install .)")
    with_cuda = _want_cuda(torch)
    if with_cuda and "torch.utils.cpp_extension" not in sys.modules:
        pin_cuda_home(stderr_line)
    openmp = openmp_flags(torch)
    cflags = cxx_flags(bool(openmp)) + ["-DHETEROSPEC_NO_PYTHON"]
    sources = cpu_sources(csrc)
    cuda_flags: List[str] = []
    if with_cuda:
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None or not (shutil.which("nvcc") or os.path.isfile(os.path.join(CUDA_HOME, "bin", "nvcc"))):
            stderr_line("heterospec: torch has CUDA but no CUDA toolkit (nvcc) was found: compiling the CPU "
                        "kernels only (set CUDA_HOME to build the CUDA ones)")
            with_cuda = False
        else:
            sources += cuda_sources(csrc)
            cflags.append("-DHETEROSPEC_WITH_CUDA=1")
            cuda_flags = nvcc_flags() + ["-DHETEROSPEC_WITH_CUDA=1"]
            if not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
                os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"   # torch cannot infer the arch without a GPU
    build_dir = _cache_dir(torch, csrc, with_cuda, cflags + cuda_flags + link_flags(openmp))
    lib = os.path.join(build_dir, JIT_NAME + ".so")
    if os.path.isfile(os.path.join(build_dir, _BUILD_MARKER)) and os.path.isfile(lib):
        torch.ops.load_library(lib)
        return lib

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise _jit_error(
            f"{reason}, so they are compiled on first import, but no C++ compiler was found ({cxx!r} is not on "
            f"PATH). Install one (Debian/Ubuntu: apt-get install g++; Fedora: dnf install gcc-c++) and import "
            f"heterospec again, or install a heterospec built ahead of time elsewhere "
            f"(pip install --no-build-isolation . on a machine with a compiler and this torch).")
    if not _find_ninja():
        raise _jit_error(f"{reason}, so they are compiled on first import, which needs ninja: pip install ninja")
    try:
        os.makedirs(build_dir, exist_ok=True)
    except OSError as exc:
        raise _jit_error(f"cannot create the build cache {build_dir} ({exc}); set HETEROSPEC_CACHE to a "
                         f"writable directory") from exc
    n = len(sources)
    jobs = os.environ.get("MAX_JOBS")
    stderr_line(f"heterospec: {reason}: compiling the C++ {'and CUDA ' if with_cuda else ''}ops for torch "
                f"{torch.__version__} ({n} sources{f', MAX_JOBS={jobs}' if jobs else ''}; about "
                f"{'5-15' if with_cuda else '1-3'} minutes, once) into {build_dir}")
    from torch.utils.cpp_extension import load

    t0 = time.time()
    try:
        with CompileProgress(build_dir, n, [stderr_line]):
            load(name=JIT_NAME, sources=sources, extra_cflags=cflags, extra_cuda_cflags=cuda_flags or None,
                 extra_ldflags=link_flags(openmp), extra_include_paths=[csrc], build_directory=build_dir,
                 with_cuda=with_cuda, is_python_module=False, verbose=False)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        tail = "\n".join(str(exc).splitlines()[-40:])
        raise _jit_error(f"the build in {build_dir} failed:\n{tail}") from exc
    try:
        check_shared_cxx_runtime(lib)
    except RuntimeError as exc:
        raise _jit_error(str(exc)) from exc
    with open(os.path.join(build_dir, _BUILD_MARKER), "w") as f:
        json.dump({"torch": torch.__version__, "cuda": with_cuda, "sources": n,
                   "seconds": round(time.time() - t0, 1), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, f)
    stderr_line(f"heterospec: C++ ops compiled in {time.time() - t0:.0f} s (cached; later imports load them "
                f"directly)")
    return lib


_KERNELS_ID: Optional[str] = None


def kernels_id() -> Optional[str]:
    """A short hash of the library that registered the ops (None before ``ensure_ops()`` or if it
    cannot be read). Measured costs hold for the kernels they were measured with: a rebuilt or
    upgraded library (a faster attention, say) times differently."""
    global _KERNELS_ID
    if _KERNELS_ID is None and LIBRARY is not None:
        try:
            with open(LIBRARY, "rb") as f:
                _KERNELS_ID = hashlib.sha1(f.read()).hexdigest()[:12]
        except OSError:
            pass
    return _KERNELS_ID


def ensure_ops() -> str:
    """Register ``torch.ops.heterospec.*`` once per process; returns how ("prebuilt" or "jit")."""
    global LOADED, LIBRARY
    if LOADED is not None:
        return LOADED
    if os.environ.get(JIT_ENV, "0") not in ("", "0"):
        LIBRARY, LOADED = _jit(f"{JIT_ENV}=1"), "jit"
        return LOADED
    name = f"{__package__}._C"
    if importlib.util.find_spec(name) is None:
        LIBRARY, LOADED = _jit("this heterospec was installed without its compiled ops"), "jit"
        return LOADED
    try:
        _C = importlib.import_module(name)  # registers torch.ops.heterospec.*
    except ImportError as exc:
        # built against another torch (undefined symbols): compile a matching copy instead
        import torch

        stderr_line(f"heterospec: the prebuilt extension does not load with torch {torch.__version__} ({exc}); "
                    f"rebuild it with `pip install --no-build-isolation .` to skip the following")
        LIBRARY, LOADED = _jit("the prebuilt extension does not load with this torch"), "jit"
        return LOADED
    LIBRARY, LOADED = getattr(_C, "__file__", None), "prebuilt"
    return LOADED
