"""Build glue for heterospec's C++/CUDA extension (heterospec._C).

The extension is compiled against the torch that is already installed, so always build without
build isolation:

    pip install --no-build-isolation -e .          # development
    python setup.py build_ext --inplace            # fast incremental rebuild after that

Switches (environment variables):
    HETEROSPEC_FORCE_CPU=1   build only the CPU kernels even when torch has CUDA
    TORCH_CUDA_ARCH_LIST     CUDA archs (default 9.0 when no GPU is visible)
    MAX_JOBS                 parallel compile jobs (ninja)
"""

import glob
import os
import sys

from setuptools import setup

BUILD_CMD = "pip install --no-build-isolation ."

try:
    import torch
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
    extra = {"cxx": ["-O3", "-g0"] + _openmp_flags()}
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
