"""Build glue for heterospec's C++/CUDA extension (heterospec._C).

The extension is compiled against the torch that is already installed, so always build without
build isolation:

    pip install --no-build-isolation -e .          # development
    python setup.py build_ext --inplace            # fast incremental rebuild after that

Switches (environment variables):
    HETEROSPEC_FORCE_CPU=1   build only the CPU kernels even when torch has CUDA
    TORCH_CUDA_ARCH_LIST     CUDA archs (default 9.0 when no GPU is visible)
    CUDA_HOME                CUDA toolkit (default: the one the nvcc on PATH runs from)
    MAX_JOBS                 parallel compile jobs (ninja)
"""

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

BUILD_CMD = "pip install --no-build-isolation ."


def _pin_cuda_home() -> None:
    """Set CUDA_HOME to the toolkit the `nvcc` on PATH really runs from, when torch would guess wrong.

    With neither CUDA_HOME nor CUDA_PATH set, torch.utils.cpp_extension (at import) takes the parent
    of the nvcc on PATH. If that nvcc is a wrapper script or symlink outside the toolkit (e.g.
    /usr/local/bin/nvcc running /usr/local/cuda-13.0/bin/nvcc), the guess (/usr/local) has no CUDA
    headers or libcudart: the .cu files still compile, but the link fails with `cannot find -lcudart`.
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
        out = subprocess.run(
            [nvcc, "-dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        tops = re.findall(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
        candidates += [os.path.realpath(top) for top in tops]
    except (OSError, subprocess.SubprocessError):
        pass
    for home in candidates:
        if is_toolkit(home):
            print(f"heterospec: CUDA_HOME={home} (the toolkit behind {nvcc})")
            os.environ["CUDA_HOME"] = home
            return


try:
    import torch

    if torch.version.cuda is not None and os.environ.get("HETEROSPEC_FORCE_CPU", "0") != "1":
        _pin_cuda_home()  # before importing cpp_extension, which fixes CUDA_HOME at import time
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError as exc:  # an isolated build env, or torch not installed yet
    sys.exit(
        "heterospec builds against the installed torch, which could not be imported "
        f"({exc}).\nInstall torch first, then build with:\n    {BUILD_CMD}\n"
        "(or `pip install --no-build-isolation -e .` for development)."
    )

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern: str) -> list[str]:
    # setuptools wants paths relative to the project root.
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _with_cuda() -> bool:
    if os.environ.get("HETEROSPEC_FORCE_CPU", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def _openmp_flags() -> list[str]:
    # at::parallel_for is inline: with torch's OpenMP backend it is a `#pragma omp parallel` in our
    # own code, so without -fopenmp every CPU kernel silently runs on one thread. The library
    # resolves (by soname) to the libgomp that torch already loaded: one OpenMP runtime.
    if sys.platform == "darwin" or not torch.backends.openmp.is_available():
        return []
    return ["-fopenmp"]


def _extension():
    sources = _sources("csrc/*.cpp") + _sources("csrc/cpu/*.cpp")
    # No -std=...: torch's BuildExtension picks the standard its headers need.
    # -fno-trapping-math: we never read FP exception flags, and it lets GCC turn the selects of
    # the portable topk_entropy loop into vector blends (4x on that path; results unchanged).
    extra = {"cxx": ["-O3", "-g0", "-fno-trapping-math"] + _openmp_flags()}
    link = _openmp_flags()
    include_dirs = [os.path.join(ROOT, "csrc")]
    if not _with_cuda():
        return CppExtension(
            "heterospec._C", sources, include_dirs=include_dirs, extra_compile_args=extra, extra_link_args=link
        )
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
        # Without a visible GPU torch cannot infer the arch (IndexError in _get_cuda_arch_flags).
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    sources += _sources("csrc/cuda/*.cu")
    extra["nvcc"] = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]
    return CUDAExtension(
        "heterospec._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args=extra,
        extra_link_args=link,
        define_macros=[("HETEROSPEC_WITH_CUDA", "1")],
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
