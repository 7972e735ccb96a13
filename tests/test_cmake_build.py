"""The CMake-built library (a plain shared library, no Python module) loads with
torch.ops.load_library and runs the ops. Only runs when HETEROSPEC_CMAKE_LIB points at it:

    cmake -S . -B build-cmake -G Ninja && cmake --build build-cmake -j 2
    HETEROSPEC_CMAKE_LIB=build-cmake/libheterospec_ops.so python -m pytest tests/test_cmake_build.py
"""

import os
import subprocess
import sys

import pytest

LIB = os.environ.get("HETEROSPEC_CMAKE_LIB")

pytestmark = [
    pytest.mark.cmake,
    pytest.mark.skipif(not LIB, reason="set HETEROSPEC_CMAKE_LIB to the CMake-built libheterospec_ops.so"),
]

# Runs in a fresh interpreter: the package's own _C registers the same library name, so the two
# must never be loaded into one process.
SCRIPT = r"""
import math, sys
import torch
torch.ops.load_library(sys.argv[1])
assert "heterospec" not in sys.modules
ops = torch.ops.heterospec
lp, ids, h = ops.topk_entropy(torch.tensor([[math.log(4), math.log(2), 0.0, 0.0]]), 2)
assert ids.tolist() == [[0, 1]], ids
assert abs(h.item() - (-(2/3) * math.log(2/3) - (1/3) * math.log(1/3))) < 1e-6, h
mask, pos, fc, ns = ops.build_tree(torch.tensor([[-1, 0, 0, 1]]), torch.tensor([4]), torch.tensor([5]))
assert pos.tolist() == [[5, 6, 6, 7]] and fc.tolist() == [[1, 3, -1, -1]] and ns.tolist() == [[-1, 2, -1, -1]]
try:
    ops.build_tree(torch.tensor([[-1, 0, 5, 1]]), torch.tensor([4]), torch.tensor([5]))
except ValueError as e:
    assert "invalid tree_parents[0, 2] = 5" in str(e), e
else:
    raise AssertionError("no error on an invalid tree")
print("CMAKE_LIB_OK")
"""


def test_cmake_library_loads_and_runs():
    lib = os.path.abspath(LIB)
    assert os.path.exists(lib), f"HETEROSPEC_CMAKE_LIB={LIB} does not exist"
    res = subprocess.run([sys.executable, "-c", SCRIPT, lib], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "CMAKE_LIB_OK" in res.stdout, res.stdout + res.stderr


def test_cmake_library_has_no_python_dependency():
    if sys.platform != "linux":
        pytest.skip("ldd check is Linux-only")
    out = subprocess.run(["ldd", os.path.abspath(LIB)], capture_output=True, text=True).stdout
    assert "libpython" not in out and "libtorch_python" not in out, out
