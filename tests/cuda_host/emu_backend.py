"""heterospec's CUDA kernels on the host SIMT emulator, callable like ``torch.ops.heterospec``.

``load_emu_ops()`` compiles tests/cuda_host/emu_ops.cpp (the torch-free kernels of
csrc/cuda/kernels/*.cuh under tests/cuda_host/simt_emu.h) into a shared library once per process
and returns an object with the nine ops. They take and return CPU tensors and make the same
decisions as the CUDA launchers (csrc/cuda/*.cu): contiguous copies, output allocation, vector
paths by alignment. Returns None when g++ or the CUDA headers are missing.
Used by tests/test_ops_cuda_parity.py as the "emu" device, next to the real "cuda" one.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

_I64, _F32 = torch.int64, torch.float32
_P = ctypes.c_void_p
_L = ctypes.c_int64


def cuda_include_dir() -> Path | None:
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


def _sources() -> list[Path]:
    return [HERE / "emu_ops.cpp", HERE / "simt_emu.h", ROOT / "csrc/cuda/common.cuh",
            *sorted((ROOT / "csrc/cuda/kernels").glob("*.cuh"))]


def build_library() -> Path | None:
    cxx = os.environ.get("CXX") or shutil.which("g++")
    inc = cuda_include_dir()
    if not cxx or inc is None or not sys.platform.startswith("linux"):
        return None
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in _sources())).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"heterospec_emu_{os.getuid()}_{digest}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", f"-I{ROOT / 'csrc'}", f"-I{inc}",
               str(HERE / "emu_ops.cpp"), "-o", str(tmp)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building the kernel emulator failed:\n{' '.join(cmd)}\n{res.stderr[-6000:]}")
        os.replace(tmp, out)
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class EmuOps:
    """The nine ops, run by the CUDA kernels on the emulator (CPU tensors in and out)."""

    def __init__(self, path: Path):
        self._lib = ctypes.CDLL(str(path))
        self._lib.hs_emu_last_error.restype = ctypes.c_char_p
        sig = {
            "hs_emu_topk_entropy": [_P, ctypes.c_int, _L, _L, _L, _L, _P, _P, _P, _P],
            "hs_emu_entropy_bin_policy": [_P, _P, _P, _P, _L, _L, _P, _P, _P],
            "hs_emu_select_tree_nodes": [_P, _P, _P, _L, _L, _L, _P, _P, _P],
            "hs_emu_build_tree": [_P, _P, _P, _L, _L, _P, _P, _P, _P],
            "hs_emu_tree_attention_mask": [_P, _P, _P, _L, _L, _L, _P, _P],
            "hs_emu_dense_tree_attention_mask": [_P, _P, _L, _L, _L, _P],
            "hs_emu_verify_greedy": [_P, _P, _P, _P, _P, _L, _L, _P, _P, _P],
            "hs_emu_verify_sampling": [_P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _P, _P, _P],
            "hs_emu_compact_kv": [_P, _P, _P, _P, _P, _L, _L, _L, _L, _L],
        }
        for name, args in sig.items():
            fn = getattr(self._lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int

    def _call(self, name, *args):
        if getattr(self._lib, name)(*args) != 0:
            raise RuntimeError(f"{name}: {self._lib.hs_emu_last_error().decode()}")

    # 1
    def topk_entropy(self, logits, k, parent_entropy=None):
        M, V = logits.shape
        if not (logits.stride(1) == 1 or V <= 1):
            logits = logits.contiguous()
        code = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[logits.dtype]
        parent = None if parent_entropy is None else parent_entropy.contiguous()
        lp, ids, h = torch.empty(M, k), torch.empty(M, k, dtype=_I64), torch.empty(M)
        self._call("hs_emu_topk_entropy", _ptr(logits), code, M, V, logits.stride(0), k, _ptr(parent),
                   _ptr(lp), _ptr(ids), _ptr(h))
        return lp, ids, h

    # 3
    def entropy_bin_policy(self, path_entropy, bin_edges, bin_extra_depth, bin_budget):
        h, e = path_entropy.contiguous(), bin_edges.contiguous()
        xd, bb = bin_extra_depth.contiguous(), bin_budget.contiguous()
        B = h.shape[0]
        out = [torch.empty(B, dtype=_I64) for _ in range(3)]
        self._call("hs_emu_entropy_bin_policy", _ptr(h), _ptr(e), _ptr(xd), _ptr(bb), B, e.shape[0],
                   *map(_ptr, out))
        return tuple(out)

    # 2
    def select_tree_nodes(self, scores, parents, budgets, max_nodes):
        s, p, b = scores.contiguous(), parents.contiguous(), budgets.contiguous()
        B, C = s.shape
        T = max_nodes + 1
        tc, tp, nn = torch.empty(B, T, dtype=_I64), torch.empty(B, T, dtype=_I64), torch.empty(B, dtype=_I64)
        if B:
            self._call("hs_emu_select_tree_nodes", _ptr(s), _ptr(p), _ptr(b), B, C, max_nodes, _ptr(tc), _ptr(tp),
                       _ptr(nn))
        return tc, tp, nn

    # 4
    def build_tree(self, tree_parents, num_nodes, prefix_lens):
        par, n, L = tree_parents.contiguous(), num_nodes.contiguous(), prefix_lens.contiguous()
        B, T = par.shape
        mask = torch.empty(B, T, T, dtype=torch.bool)
        pos, fc, ns = (torch.empty(B, T, dtype=_I64) for _ in range(3))
        self._call("hs_emu_build_tree", _ptr(par), _ptr(n), _ptr(L), B, T, _ptr(mask), _ptr(pos), _ptr(fc), _ptr(ns))
        return mask, pos, fc, ns

    # 5
    def tree_attention_mask(self, tree_mask, num_nodes, prefix_lens, mask_numel):
        tm, n, L = tree_mask.contiguous(), num_nodes.contiguous(), prefix_lens.contiguous()
        B, T, _ = tm.shape
        cm = torch.empty(mask_numel, dtype=torch.bool)
        if B == 0 or T == 0:
            return cm, torch.zeros(B + 1, dtype=_I64)
        ip = torch.empty(B + 1, dtype=_I64)
        self._call("hs_emu_tree_attention_mask", _ptr(tm), _ptr(n), _ptr(L), B, T, mask_numel, _ptr(cm), _ptr(ip))
        return cm, ip

    # 6
    def dense_tree_attention_mask(self, tree_mask, prefix_lens, width):
        tm, L = tree_mask.contiguous(), prefix_lens.contiguous()
        B, T, _ = tm.shape
        out = torch.empty(B, T, width, dtype=torch.bool)
        self._call("hs_emu_dense_tree_attention_mask", _ptr(tm), _ptr(L), B, T, width, _ptr(out))
        return out

    # 7
    def verify_greedy(self, tree_tokens, target_ids, first_child, next_sibling, num_nodes):
        tok, tgt = tree_tokens.contiguous(), target_ids.contiguous()
        fc, ns, n = first_child.contiguous(), next_sibling.contiguous(), num_nodes.contiguous()
        B, T = tok.shape
        path, alen, bonus = torch.empty(B, T, dtype=_I64), torch.empty(B, dtype=_I64), torch.empty(B, dtype=_I64)
        self._call("hs_emu_verify_greedy", _ptr(tok), _ptr(tgt), _ptr(fc), _ptr(ns), _ptr(n), B, T, _ptr(path),
                   _ptr(alen), _ptr(bonus))
        return path, alen, bonus

    # 8
    def verify_sampling(self, tree_tokens, target_probs, first_child, next_sibling, num_nodes, coins, final_coins):
        tok, probs = tree_tokens.contiguous(), target_probs.contiguous()
        fc, ns, n = first_child.contiguous(), next_sibling.contiguous(), num_nodes.contiguous()
        u, fu = coins.contiguous(), final_coins.contiguous()
        B, T = tok.shape
        V = probs.shape[2]
        path, alen, bonus = torch.empty(B, T, dtype=_I64), torch.empty(B, dtype=_I64), torch.empty(B, dtype=_I64)
        self._call("hs_emu_verify_sampling", _ptr(tok), _ptr(probs), _ptr(fc), _ptr(ns), _ptr(n), _ptr(u), _ptr(fu),
                   B, T, V, _ptr(path), _ptr(alen), _ptr(bonus))
        return path, alen, bonus

    # 9
    def compact_kv_(self, k_cache, v_cache, accept_path, accept_len, prefix_lens):
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
        if k_cache.numel() == 0:
            return None
        NL, B, S, H, D = k_cache.shape
        path, alen, L = accept_path.contiguous(), accept_len.contiguous(), prefix_lens.contiguous()
        self._call("hs_emu_compact_kv", _ptr(k_cache), _ptr(v_cache), _ptr(path), _ptr(alen), _ptr(L), NL, B, S,
                   path.shape[1], H * D * k_cache.element_size())
        return None


_CACHED: list = []


def load_emu_ops() -> EmuOps | None:
    if not _CACHED:
        path = build_library()
        _CACHED.append(None if path is None else EmuOps(path))
    return _CACHED[0]
