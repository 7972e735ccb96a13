"""The built ops library carries the shared C++ runtime (heterospec/_ext.py link_flags).

On the GPU host (torch 2.11+cu130, 26 Nov 2026) the default compiler links libstdc++ statically:
every C++ exception of our ops (a ValueError for a bad input) killed the process with SIGSEGV.
These tests fail if a build drops the shared libstdc++ again or if the flag stops overriding a
compiler that asks for the static one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import heterospec
from heterospec import _ext

linux_gnu = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("readelf") is None,
                               reason="ELF/readelf only")


@linux_gnu
def test_loaded_ops_library_needs_the_shared_libstdcxx():
    heterospec.ops  # noqa: B018 (the import registers the ops)
    lib = _ext.LIBRARY
    assert lib, "the ops library was not loaded"
    needed = _ext.needed_libraries(lib)
    assert needed is not None and any(n.startswith("libstdc++") for n in needed), needed
    _ext.check_shared_cxx_runtime(lib)


def test_an_op_error_is_a_value_error_not_a_crash():
    # In a child process: the failure mode this guards against is a dead interpreter.
    code = ("import torch, heterospec\n"
            "try:\n    torch.ops.heterospec.topk_entropy(torch.randn(3, 5), 9, None)\n"
            "except ValueError as e:\n    print('ValueError', e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert "ValueError topk_entropy: expected 1 <= k" in p.stdout


@linux_gnu
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_link_flags_override_a_static_libstdcxx_compiler(tmp_path):
    src = tmp_path / "x.cpp"
    src.write_text('#include <stdexcept>\nextern "C" void boom() { throw std::runtime_error("x"); }\n')
    static = tmp_path / "static.so"
    fixed = tmp_path / "fixed.so"
    base = ["g++", "-shared", "-fPIC", "-static-libstdc++", str(src)]   # what the GPU host's wrapper does
    subprocess.run(base + ["-o", str(static)], check=True, timeout=120)
    subprocess.run(base + ["-o", str(fixed)] + _ext.link_flags(["-fopenmp"]), check=True, timeout=120)
    assert not any(n.startswith("libstdc++") for n in _ext.needed_libraries(str(static)))
    with pytest.raises(RuntimeError, match="linked without the shared libstdc\\+\\+"):
        _ext.check_shared_cxx_runtime(str(static))
    assert any(n.startswith("libstdc++") for n in _ext.needed_libraries(str(fixed)))
    _ext.check_shared_cxx_runtime(str(fixed))
    # no second copy of the runtime inside the library
    syms = subprocess.run(["nm", "-D", "--defined-only", str(fixed)], capture_output=True, text=True).stdout
    assert "__cxa_throw" not in syms


@linux_gnu
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_link_flags_win_over_a_folder_with_only_the_static_libstdcxx(tmp_path):
    # The GPU host's compiler searches a folder holding libstdc++.a but no libstdc++.so first:
    # `-Bdynamic -lstdc++` then takes the archive; naming the loaded runtime by path does not.
    archive = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(archive) or not os.path.isfile(archive):
        pytest.skip("no libstdc++.a to stage")
    only_static = tmp_path / "gcc-lib"
    only_static.mkdir()
    os.symlink(archive, only_static / "libstdc++.a")
    src = tmp_path / "x.cpp"
    src.write_text('#include <stdexcept>\nextern "C" void boom() { throw std::runtime_error("x"); }\n')
    base = ["g++", "-shared", "-fPIC", "-static-libstdc++", f"-L{only_static}", str(src)]
    by_name = tmp_path / "by_name.so"
    subprocess.run(base + ["-o", str(by_name), "-Wl,--push-state,--no-as-needed,-Bdynamic,-lstdc++,--pop-state"],
                   check=True, timeout=120)
    assert not any(n.startswith("libstdc++") for n in _ext.needed_libraries(str(by_name)))  # the old flag loses
    assert _ext.shared_cxx_runtime() is not None  # torch has loaded it
    fixed = tmp_path / "fixed.so"
    subprocess.run(base + ["-o", str(fixed)] + _ext.link_flags([]), check=True, timeout=120)
    _ext.check_shared_cxx_runtime(str(fixed))


def test_link_flags_keep_openmp():
    assert _ext.link_flags(["-fopenmp"])[0] == "-fopenmp"
    assert torch.ops.heterospec.topk_entropy is not None
