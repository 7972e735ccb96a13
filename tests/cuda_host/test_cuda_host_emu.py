"""The CUDA kernels (csrc/cuda/kernels/*.cuh) executed on the host SIMT emulator, vs references.

No GPU needed: tests/cuda_host/test_kernels_emu.cpp includes the torch-free kernel headers under
tests/cuda_host/simt_emu.h (CUDA threads as cooperative fibers) and compares every op's kernels,
launched through the same schedules as the extension, with host references of docs/design.md.
Needs g++ (C++20) and the CUDA toolkit headers (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h);
skipped otherwise. ~15 s on 2 cores (compile ~7 s, run ~9 s). Memory-safety run (manual, ~3 min):

    g++ -std=c++20 -O1 -g -fsanitize=address,undefined -I csrc -I <cuda>/include \
        tests/cuda_host/test_kernels_emu.cpp -o /tmp/hs_emu_asan
    ASAN_OPTIONS=detect_stack_use_after_return=0 /tmp/hs_emu_asan   # (ASan warns about the fibers)
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _cuda_include() -> Path | None:
    cands = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(Path(nvcc).resolve().parent.parent / "include")
    cands += [Path("/usr/local/cuda/include")] + sorted(Path("/usr/local").glob("cuda-*/include"), reverse=True)
    for c in cands:
        if (c / "cuda_runtime.h").is_file() and (c / "cuda_bf16.h").is_file():
            return c
    return None


@pytest.fixture(scope="module")
def emu_binary(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("g++")
    inc = _cuda_include()
    if not cxx or inc is None or not sys.platform.startswith("linux"):
        pytest.skip("needs g++ and the CUDA toolkit headers on Linux")
    out = tmp_path_factory.mktemp("cuda_host") / "hs_emu"
    cmd = [cxx, "-std=c++20", "-O1", f"-I{ROOT / 'csrc'}", f"-I{inc}", str(HERE / "test_kernels_emu.cpp"), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"compiling the emulator test failed:\n{' '.join(cmd)}\n{res.stderr[-6000:]}"
    return out


@pytest.mark.parametrize(
    "group",
    ["bin_policy", "compact_kv", "verify_greedy", "tree_masks", "select", "verify_sampling", "topk", "invalid_inputs"],
)
def test_cuda_kernels_on_host_emulator(emu_binary, group):
    res = subprocess.run([str(emu_binary), group], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{group}: kernel output differs from the reference\n{res.stdout[-6000:]}{res.stderr[-2000:]}"
    assert " 0 failures" in res.stdout, res.stdout
