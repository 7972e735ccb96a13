"""Build glue for heterospec's C++/CUDA extension (heterospec._C).

Two ways to install, both compiling the ops against the torch that runs them:

    pip install .                                  # plain: pip's isolated build cannot see torch, so this
                                                   # builds a pure-Python package (with the C++ sources in
                                                   # heterospec/_csrc); the ops compile on first import
                                                   # (once per torch version, cached; heterospec/_ext.py)
    pip install --no-build-isolation .             # ahead of time, against the installed torch
    pip install --no-build-isolation -e .          # development
    python setup.py build_ext --inplace            # fast incremental rebuild after that

Switches (environment variables):
    HETEROSPEC_FORCE_CPU=1   build only the CPU kernels even when torch has CUDA
    TORCH_CUDA_ARCH_LIST     CUDA archs (default 9.0 when no GPU is visible)
    CUDA_HOME                CUDA toolkit (default: the one the nvcc on PATH runs from)
    MAX_JOBS                 parallel compile jobs (ninja)
"""

import importlib.util
import os
import shutil
import sys
import time

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")
BUILD_CMD = "pip install --no-build-isolation ."


def _load_ext_module():
    """heterospec/_ext.py (sources, flags, progress), loaded by path: importing the package would
    import torch and try to load the ops."""
    spec = importlib.util.spec_from_file_location("_heterospec_ext_build", os.path.join(ROOT, "heterospec", "_ext.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EXT = _load_ext_module()


def _say(line: str) -> None:
    """Progress for the user: stderr, and the terminal when pip captures the build's output (pip shows
    the backend's output only with -v)."""
    print(line, file=sys.stderr, flush=True)
    try:
        if os.isatty(sys.stderr.fileno()):
            return
    except (OSError, ValueError, AttributeError):
        pass
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line + "\n")
    except OSError:
        pass


class BuildPyWithSources(build_py):
    """Ships the C++/CUDA sources as heterospec/_csrc, so an installed copy can compile its ops on first
    import (the pure-Python install) or again after torch changed (any install)."""

    def run(self):
        super().run()
        dest_root = os.path.join(self.build_lib, "heterospec", "_csrc")
        for src in EXT.source_files(CSRC):
            dest = os.path.join(dest_root, os.path.relpath(src, CSRC))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copy2(src, dest)


try:
    import torch
except ImportError as _exc:  # pip's isolated build (torch is deliberately no build requirement), or no torch
    torch = None
    _say(
        f"heterospec: torch is not importable in this build environment ({_exc}; pip's default isolated build "
        f"hides the installed torch). Building the pure-Python package: the C++ ops are compiled against the "
        f"installed torch on first import (1-3 minutes once, then cached). To compile them now instead: "
        f"{BUILD_CMD}"
    )


def _rel(paths) -> list:
    # setuptools wants paths relative to the project root.
    return [os.path.relpath(p, ROOT) for p in paths]


def _with_cuda(CUDA_HOME) -> bool:
    if os.environ.get("HETEROSPEC_FORCE_CPU", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def _ahead_of_time() -> dict:
    """setup() arguments that compile heterospec._C against the importable torch."""
    if torch.version.cuda is not None and os.environ.get("HETEROSPEC_FORCE_CPU", "0") != "1":
        EXT.pin_cuda_home()  # before importing cpp_extension, which fixes CUDA_HOME at import time
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    with_cuda = _with_cuda(CUDA_HOME)
    sources = _rel(EXT.cpu_sources(CSRC))
    # No -std=...: torch's BuildExtension picks the standard its headers need.
    openmp = EXT.openmp_flags(torch)
    extra = {"cxx": EXT.cxx_flags(bool(openmp))}
    include_dirs = [CSRC]
    if not with_cuda:
        ext = CppExtension(
            "heterospec._C", sources, include_dirs=include_dirs, extra_compile_args=extra,
            extra_link_args=EXT.link_flags(openmp)
        )
    else:
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
            # Without a visible GPU torch cannot infer the arch (IndexError in _get_cuda_arch_flags).
            os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        sources += _rel(EXT.cuda_sources(CSRC))
        extra["nvcc"] = EXT.nvcc_flags()
        ext = CUDAExtension(
            "heterospec._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args=extra,
            extra_link_args=EXT.link_flags(openmp),
            define_macros=[("HETEROSPEC_WITH_CUDA", "1")],
        )

    class BuildExtensionWithProgress(BuildExtension.with_options(use_ninja=True)):
        """torch's BuildExtension (ninja), plus progress lines while the sources compile."""

        def build_extension(self, ext):
            n = len(ext.sources)
            jobs = os.environ.get("MAX_JOBS")
            _say(f"heterospec: compiling the C++{' and CUDA' if with_cuda else ''} ops against torch "
                 f"{torch.__version__} ({n} sources{f', MAX_JOBS={jobs}' if jobs else ''}; about "
                 f"{'5-15' if with_cuda else '1-3'} minutes) ...")
            t0 = time.time()
            with EXT.CompileProgress(self.build_temp, n, [_say]):
                super().build_extension(ext)
            EXT.check_shared_cxx_runtime(self.get_ext_fullpath(ext.name))
            _say(f"heterospec: C++ ops built in {time.time() - t0:.0f} s")

    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtensionWithProgress, "build_py": BuildPyWithSources}}


if torch is None:
    setup(cmdclass={"build_py": BuildPyWithSources})
else:
    setup(**_ahead_of_time())
