"""CUDA kernels vs the CPU kernels, op by op, on random inputs.

Every op runs on the same inputs on the CPU (``torch.ops.heterospec``, the CPU kernels) and on a
"device" (fixture ``dev``): integer outputs must match exactly, float outputs within float
tolerance. Devices:
  * ``cuda``: the real CUDA kernels (needs a GPU and heterospec built with CUDA; else skipped);
  * ``emu``: the same kernel code (csrc/cuda/kernels/*.cuh) run on the host SIMT emulator
    (tests/cuda_host/emu_backend.py; needs g++ and the CUDA headers), so CPU-only CI checks the
    kernels' logic too. The largest shapes are skipped on ``emu`` (too slow to emulate).
Shapes include awkward ones (1-element, odd vocabularies, unaligned rows, strided views, more
candidates than fit in shared memory, several topk_entropy merge levels) and every dtype.
CUDA only: no op synchronises with the host (``torch.cuda.set_sync_debug_mode("error")``) and
a whole round can be captured in a CUDA graph. Both: inputs the CPU op rejects (raising would
need a device sync) are flagged or handled memory-safely as documented in the kernel headers.

GPU host: ``python -m pytest -q tests/test_ops_cuda_parity.py`` (after building with CUDA).
"""

import math
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

import heterospec  # noqa: F401  (loads the extension: CPU kernels and, in a CUDA build, CUDA ones)
from heterospec import ops
from cuda_host.emu_backend import load_emu_ops
from reference.samples import random_candidates, random_tree

hs = torch.ops.heterospec


def _has_cuda_kernels() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("heterospec::topk_entropy", "CUDA")
    except Exception:
        return False


@dataclass
class Dev:
    name: str
    ops: Any  # the nine ops
    put: Callable[[torch.Tensor], torch.Tensor]  # a CPU tensor onto the device (a copy)
    max_work: float  # larger cases are skipped (emulation is slow)

    def heavy(self, work: float) -> None:
        if work > self.max_work:
            pytest.skip(f"too large to emulate ({work:.3g} > {self.max_work:.3g})")


@pytest.fixture(scope="module", params=["cuda", "emu"])
def dev(request) -> Dev:
    if request.param == "cuda":
        if not _has_cuda_kernels():
            pytest.skip("needs a GPU and heterospec built with CUDA")
        return Dev("cuda", hs, lambda t: t.cuda(), math.inf)
    ops = load_emu_ops()
    if ops is None:
        pytest.skip("the kernel emulator needs g++ and the CUDA headers")
    return Dev("emu", ops, lambda t: t.clone(), 1.5e6)


def _cuda_only(dev: Dev) -> None:
    if dev.name != "cuda":
        pytest.skip("CUDA runtime behaviour")


DT = [torch.float32, torch.float16, torch.bfloat16]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _eq(a, b, what):
    a, b = a.cpu(), b.cpu()
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    if not torch.equal(a, b):
        bad = (a != b).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int((a != b).sum())} mismatches, first at {bad}")


# ---------------------------------------------------------------------------------------------
# 1. topk_entropy
# ---------------------------------------------------------------------------------------------
def _topk_parity(dev, logits, k, parent=None, view=None):
    """`view` (optional) is applied to the logits on both sides (strided views stay strided)."""
    d_logits = dev.put(logits)
    if view is not None:
        logits, d_logits = view(logits), view(d_logits)
    c = hs.topk_entropy(logits, k, parent)
    g = dev.ops.topk_entropy(d_logits, k, None if parent is None else dev.put(parent))
    _eq(g[1], c[1], "topk_ids")
    torch.testing.assert_close(g[0].cpu(), c[0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(g[2].cpu(), c[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize(
    "M,V,k",
    [(1, 1, 1), (3, 7, 5), (2, 64, 64), (16, 1000, 64), (7, 4099, 16), (5, 8192, 8), (5, 8193, 8),
     (64, 32000, 8), (64, 128256, 10), (3, 128256, 64), (2, 262145, 64), (1, 600000, 3), (300, 1024, 4)],
)
@pytest.mark.parametrize("scale", [0.01, 3.0, 40.0])
def test_topk_entropy(dev, dtype, M, V, k, scale):
    dev.heavy(M * V * (1 if scale == 3.0 else 50))  # emu: one scale for all but small shapes
    g = _gen(M * 7 + V + k)
    logits = (torch.randn(M, V, generator=g) * scale).to(dtype)
    parent = torch.rand(M, generator=g) * 4 if M % 2 else None
    _topk_parity(dev, logits, k, parent)


@pytest.mark.parametrize("dtype", DT)
def test_topk_entropy_ties_masks_and_views(dev, dtype):
    g = _gen(1)
    _topk_parity(dev, torch.randint(-3, 3, (6, 30000), generator=g).to(dtype), 17)  # ties everywhere
    _topk_parity(dev, torch.zeros(3, 20000, dtype=dtype), 64)  # constant rows: ids 0..63
    x = torch.where(torch.arange(40000) % 2 == 0, 0.0, -0.0).to(dtype)[None].repeat(2, 1)
    _topk_parity(dev, x, 9)  # -0.0 == +0.0: ties by id
    m = torch.randn(4, 5000, generator=g).to(dtype)
    m[torch.rand(4, 5000, generator=g) < 0.999] = -math.inf  # fewer finite logits than k
    m[:, 4999] = 1.0
    _topk_parity(dev, m, 20)
    base = (torch.randn(6, 2 * 7777, generator=g) * 3).to(dtype)
    _topk_parity(dev, base, 9, view=lambda t: t[:, ::2])  # strided vocabulary (copied)
    _topk_parity(dev, base, 9, view=lambda t: t[:, 5:7000])  # strided, unaligned rows (scalar loads)
    _topk_parity(dev, base, 64, view=lambda t: t[:, 8:7008])  # strided, 16-byte aligned rows (vector loads)
    ramp = torch.arange(3 * 8192, dtype=torch.float32).remainder(8192)[None].repeat(2, 1).to(dtype)
    _topk_parity(dev, ramp, 64)  # per-thread candidates all above the next thread's


@pytest.mark.parametrize("V", [9000, 100])  # several chunks (merge kernel) / one chunk
def test_topk_entropy_flags_invalid_rows(dev, V):
    x = torch.randn(5, V)
    x[1, 43] = math.nan
    x[2, V - 1] = math.inf
    x[3] = -math.inf
    lp, ids, h = dev.ops.topk_entropy(dev.put(x), 8)
    for r in (1, 2, 3):  # the documented flag: -inf scores, valid ids 0..k-1, NaN entropy
        assert math.isnan(h[r].item()) and (lp[r] == -math.inf).all()
        _eq(ids[r], torch.arange(8), f"ids of invalid row {r}")
    ok = [0, 4]
    c = hs.topk_entropy(x[ok], 8)
    _eq(ids[ok], c[1], "valid rows next to invalid ones")
    torch.testing.assert_close(h[ok].cpu(), c[2], rtol=1e-5, atol=1e-5)
    _eq(ops.topk_entropy_invalid(lp), torch.tensor([False, True, True, True, False]), "topk_entropy_invalid")


@pytest.mark.parametrize("row,problem", [(1, "contains NaN"), (2, "contains +inf"),
                                         (3, "is all -inf (no token has positive probability)")])
def test_topk_entropy_error_helpers_raise_the_cpu_message(dev, row, problem):
    x = torch.randn(5, 300)
    x[1, 7] = math.nan
    x[2, 9] = math.inf
    x[3] = -math.inf
    x = x[[0, row, 4]]
    with pytest.raises(ValueError) as cpu:
        hs.topk_entropy(x, 4)
    assert f"row 1 of logits {problem};" in str(cpu.value)
    d = dev.put(x)
    lp, _, _ = dev.ops.topk_entropy(d, 4)
    flags = ops.topk_entropy_invalid(lp)  # device-side, no sync
    with pytest.raises(ValueError) as err:
        ops.raise_topk_entropy_errors(flags, d)
    assert str(err.value) == str(cpu.value)
    with pytest.raises(ValueError, match="row 1 of logits contains NaN or \\+inf, or is all -inf"):
        ops.raise_topk_entropy_errors(flags.tolist())  # host values, no logits
    ops.raise_topk_entropy_errors(ops.topk_entropy_invalid(dev.ops.topk_entropy(dev.put(x[[0, 2]]), 4)[0]))


def test_topk_entropy_empty(dev):
    lp, ids, h = dev.ops.topk_entropy(dev.put(torch.empty(0, 10)), 3)
    assert lp.shape == (0, 3) and ids.shape == (0, 3) and h.shape == (0,)


# ---------------------------------------------------------------------------------------------
# 3. entropy_bin_policy
# ---------------------------------------------------------------------------------------------
def test_entropy_bin_policy(dev):
    g = _gen(3)
    for nb in (1, 2, 5, 40):
        edges = torch.sort(torch.randn(nb - 1, generator=g) * 2).values
        if nb > 3:
            edges[1] = edges[2]  # a repeated edge
        h = torch.cat([torch.randn(300, generator=g) * 3, edges, torch.tensor([math.nan, math.inf, -math.inf])])
        depth = torch.randint(0, 5, (nb,), generator=g)
        budget = torch.randint(0, 100, (nb,), generator=g)
        c = hs.entropy_bin_policy(h, edges, depth, budget)
        d = dev.ops.entropy_bin_policy(dev.put(h), dev.put(edges), dev.put(depth), dev.put(budget))
        for a, b, name in zip(d, c, ("bins", "extra_depth", "budget")):
            _eq(a, b, name)


# ---------------------------------------------------------------------------------------------
# 2. select_tree_nodes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["monotone", "random", "ties"])
@pytest.mark.parametrize("B,C,max_nodes", [(1, 1, 0), (3, 10, 4), (8, 456, 63), (4, 1000, 127), (2, 3000, 200),
                                           (5, 64, 80), (2, 0, 7)])
def test_select_tree_nodes(dev, mode, B, C, max_nodes):
    g = _gen(B * 1000 + C)
    scores, parents = random_candidates(B, C, mode=mode, gen=g)
    budgets = torch.randint(0, max_nodes + 1, (B,), generator=g)
    budgets[0] = max_nodes
    c = hs.select_tree_nodes(scores, parents, budgets, max_nodes)
    d = dev.ops.select_tree_nodes(dev.put(scores), dev.put(parents), dev.put(budgets), max_nodes)
    for a, b, name in zip(d, c, ("tree_cand", "tree_parents", "num_nodes")):
        _eq(a, b, name)


# ---------------------------------------------------------------------------------------------
# 4-6. build_tree, tree_attention_mask, dense_tree_attention_mask
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,T", [(1, 1), (3, 2), (4, 17), (8, 64), (2, 200), (33, 9)])
def test_build_tree_and_masks(dev, B, T):
    g = _gen(B * 31 + T)
    parents, num_nodes = random_tree(B, T, gen=g)  # junk in the padding
    prefix = torch.randint(0, 300, (B,), generator=g)
    prefix[0] = 0
    c = hs.build_tree(parents, num_nodes, prefix)
    d = dev.ops.build_tree(dev.put(parents), dev.put(num_nodes), dev.put(prefix))
    for a, b, name in zip(d, c, ("tree_mask", "positions", "first_child", "next_sibling")):
        _eq(a, b, name)

    tree_mask = c[0] ^ (torch.rand(B, T, T, generator=g) < 0.1)  # the ops copy whatever the mask holds
    numel = int((num_nodes * (prefix + num_nodes)).sum())
    cm, ip = hs.tree_attention_mask(tree_mask, num_nodes, prefix, numel)
    dm, dp = dev.ops.tree_attention_mask(dev.put(tree_mask), dev.put(num_nodes), dev.put(prefix), numel)
    _eq(dp, ip, "mask_indptr")
    _eq(dm, cm, "custom_mask")

    for width in (int(prefix.max()) + T, int(prefix.max()) + T + 1, int(prefix.max()) + T + 77, 4096 + T):
        _eq(dev.ops.dense_tree_attention_mask(dev.put(tree_mask), dev.put(prefix), width),
            hs.dense_tree_attention_mask(tree_mask, prefix, width), f"dense mask width={width}")


def test_tree_attention_mask_wrong_numel_is_memory_safe(dev):
    parents, num_nodes = random_tree(4, 8, gen=_gen(5))
    prefix = torch.tensor([3, 0, 7, 1])
    tm = dev.put(hs.build_tree(parents, num_nodes, prefix)[0])
    true = int((num_nodes * (prefix + num_nodes)).sum())
    for numel in (0, true // 2, true + 5):
        cm, ip = dev.ops.tree_attention_mask(tm, dev.put(num_nodes), dev.put(prefix), numel)
        assert cm.numel() == numel and int(ip[-1]) == true  # callers compare ip[-1] with mask_numel


# ---------------------------------------------------------------------------------------------
# 7-8. verify_greedy, verify_sampling
# ---------------------------------------------------------------------------------------------
def _tree_inputs(B, T, V, g):
    parents, num_nodes = random_tree(B, T, gen=g)
    _, _, fc, ns = hs.build_tree(parents, num_nodes, torch.zeros(B, dtype=torch.int64))
    tokens = torch.randint(0, V, (B, T), generator=g)
    return tokens, fc, ns, num_nodes


@pytest.mark.parametrize("B,T,V", [(1, 1, 5), (7, 9, 3), (16, 64, 4), (64, 33, 2), (8, 64, 1000)])
def test_verify_greedy(dev, B, T, V):
    g = _gen(B + T + V)
    tokens, fc, ns, n = _tree_inputs(B, T, V, g)
    target = torch.randint(0, V, (B, T), generator=g)
    c = hs.verify_greedy(tokens, target, fc, ns, n)
    d = dev.ops.verify_greedy(*map(dev.put, (tokens, target, fc, ns, n)))
    for a, b, name in zip(d, c, ("accept_path", "accept_len", "bonus")):
        _eq(a, b, name)


def _probs(B, T, V, tokens, fc, ns, g):
    """Mixture of dense, sparse (top-k / top-p processed) and child-peaked rows."""
    p = torch.rand(B, T, V, generator=g) ** 3
    kind = torch.randint(0, 4, (B, T), generator=g)
    p[kind == 1] *= (torch.rand(int((kind == 1).sum()), V, generator=g) < 0.2).float()
    for b in range(B):
        for i in range(T):
            if kind[b, i] >= 2:  # most mass on the children's tokens: deep walks
                p[b, i] *= 0.3 / V
                c = int(fc[b, i])
                while c != -1:
                    p[b, i, int(tokens[b, c])] += 0.5
                    c = int(ns[b, c])
    empty = p.sum(-1) == 0  # every row must stay a distribution (the CPU op raises otherwise)
    p[empty, 0] = 1.0
    return p


@pytest.mark.parametrize("B,T,V", [(2, 1, 5), (16, 16, 3), (8, 64, 1001), (4, 32, 32000), (8, 64, 128256)])
def test_verify_sampling(dev, B, T, V):
    dev.heavy(B * T * V / 8)
    g = _gen(B * 3 + T + V)
    tokens, fc, ns, n = _tree_inputs(B, T, V, g)
    probs = _probs(B, T, V, tokens, fc, ns, g)
    if V == 3:
        probs[0, 0] = 0.0
        probs[0, 0, 1] = 1.0  # a single token with mass
    coins = torch.rand(B, T, generator=g) * 0.999
    final = torch.rand(B, generator=g) * 0.999
    final[0] = 0.0
    c = hs.verify_sampling(tokens, probs, fc, ns, n, coins, final)
    d = dev.ops.verify_sampling(*map(dev.put, (tokens, probs, fc, ns, n, coins, final)))
    for a, b, name in zip(d, c, ("accept_path", "accept_len", "bonus")):
        _eq(a, b, name)
    if V % 4 == 0:  # unaligned rows: the scalar-load kernel
        pd = dev.put(torch.empty(B, T, V + 1))[..., 1:]
        pd.copy_(dev.put(probs))
        d2 = dev.ops.verify_sampling(*map(dev.put, (tokens,)), pd, *map(dev.put, (fc, ns, n, coins, final)))
        for a, b, name in zip(d2, c, ("accept_path", "accept_len", "bonus")):
            _eq(a, b, name + " (unaligned)")


def test_verify_sampling_shared_memory_limit_is_named(dev):
    """The CUDA kernel keeps a node's child tokens and the row's segment masses in shared memory:
    a tree and vocabulary too large for it is a clear error, not a failed launch."""
    _cuda_only(dev)
    B, T, V = 1, 6200, 8  # 8 * 6200 + 16 * 16 > 49152
    tokens, fc, ns, n = (t.cuda() for t in _tree_inputs(B, T, V, _gen(5)))
    probs = torch.full((B, T, V), 1.0 / V, device="cuda")
    with pytest.raises(ValueError, match=r"T \* 8 \+ 16 \* ceil\(V / 1024\) <= 49152 bytes .* T = 6200, V = 8"):
        hs.verify_sampling(tokens, probs, fc, ns, n, torch.zeros(B, T, device="cuda"), torch.zeros(B, device="cuda"))


def test_verify_sampling_flags_invalid_rows(dev):
    g = _gen(9)
    tokens, fc, ns, n = _tree_inputs(3, 8, 50, g)
    probs = torch.rand(3, 8, 50, generator=g)
    probs[1, 0, 7] = -1.0  # the root of request 1 is not a distribution
    probs[2, 0] = 0.0
    out = dev.ops.verify_sampling(*map(dev.put, (tokens, probs, fc, ns, n, torch.rand(3, 8, generator=g),
                                                   torch.rand(3, generator=g))))
    assert out[2][1:].tolist() == [-1, -1] and out[1][1:].tolist() == [0, 0]
    assert ops.verify_sampling_invalid(*out)[1:].tolist() == [0, 0]


def test_verify_sampling_error_helpers_raise_the_cpu_message(dev):
    """An invalid row below the root: the walk stops at that node (the last entry of accept_path),
    the flag names it, and the helpers raise exactly the CPU op's message."""
    B, T, V = 3, 6, 20
    parents = torch.tensor([[-1, 0, 1, 2, 0, 4]] * B)  # chain 0-1-2-3 plus a branch 0-4-5
    n = torch.full((B,), T)
    _, _, fc, ns = hs.build_tree(parents, n, torch.zeros(B, dtype=torch.int64))
    tokens = torch.tensor([[0, 3, 5, 7, 9, 11]] * B)
    probs = torch.full((B, T, V), 1e-3)
    for i, t in ((0, 3), (1, 5), (2, 7)):  # the walk of every request goes 0 -> 1 -> 2 -> 3
        probs[:, i, t] = 1.0
    probs[1, 2, 4] = math.nan  # request 1 stops at node 2 (accepted; its row is invalid)
    coins, final = torch.full((B, T), 0.5), torch.full((B,), 0.5)
    with pytest.raises(ValueError) as cpu:
        hs.verify_sampling(tokens, probs, fc, ns, n, coins, final)
    assert str(cpu.value) == ("verify_sampling: target_probs[1, 2] is not a valid distribution "
                              "(a negative, NaN or inf entry, or all zeros)")
    path, alen, bonus = dev.ops.verify_sampling(*map(dev.put, (tokens, probs, fc, ns, n, coins, final)))
    assert bonus[1].item() == -1 and alen[1].item() == 2 and path[1, :4].tolist() == [0, 1, 2, -1]
    flags = ops.verify_sampling_invalid(path, alen, bonus)
    assert flags.tolist() == [-1, 2, -1]
    for arg in (flags, flags.tolist()):
        with pytest.raises(ValueError) as err:
            ops.raise_verify_sampling_errors(arg)
        assert str(err.value) == str(cpu.value)
    ok = [0, 2]
    c = hs.verify_sampling(tokens[ok], probs[ok], fc[ok], ns[ok], n[ok], coins[ok], final[ok])
    ops.raise_verify_sampling_errors(ops.verify_sampling_invalid(*c))  # valid: no error
    for a, b, name in zip((path[ok], alen[ok], bonus[ok]), c, ("accept_path", "accept_len", "bonus")):
        _eq(a, b, name + " (valid requests)")
    if dev.name == "cuda":  # the wrapper's opt-in check: one host read, the same error
        with pytest.raises(ValueError) as err:
            ops.verify_sampling(*map(dev.put, (tokens, probs, fc, ns, n, coins, final)), check_valid=True)
        assert str(err.value) == str(cpu.value)
        with pytest.raises(ValueError, match="row 0 of logits contains NaN;"):
            ops.topk_entropy(torch.full((1, 10), math.nan, device="cuda"), 2, check_finite=True)


# ---------------------------------------------------------------------------------------------
# 9. compact_kv_
# ---------------------------------------------------------------------------------------------
def _paths(B, P, S, g):
    path = torch.full((B, P), -1, dtype=torch.int64)
    alen = torch.zeros(B, dtype=torch.int64)
    pre = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        k = int(torch.randint(0, P, (1,), generator=g))
        steps = torch.randint(1, 4, (k,), generator=g)
        p = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(steps, 0)])
        path[b, : k + 1] = p
        alen[b] = k
        pre[b] = int(torch.randint(0, max(1, S - int(p[-1])), (1,), generator=g))
    return path, alen, pre


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float64])
@pytest.mark.parametrize("NL,B,S,H,D,P", [(1, 1, 4, 1, 1, 1), (2, 3, 40, 2, 8, 6), (3, 16, 64, 4, 16, 12),
                                          (1, 2, 300, 1, 128, 128), (4, 8, 256, 8, 128, 64), (2, 5, 50, 3, 5, 9)])
def test_compact_kv(dev, dtype, NL, B, S, H, D, P):
    g = _gen(NL * 100 + B * 10 + P)
    k = (torch.randn(NL, B, S, H, D, generator=g) * 10).to(dtype)
    v = (torch.randn(NL, B, S, H, D, generator=g) * 10).to(dtype)
    path, alen, pre = _paths(B, P, S, g)
    kd, vd = dev.put(k), dev.put(v)
    hs.compact_kv_(k, v, path, alen, pre)
    dev.ops.compact_kv_(kd, vd, dev.put(path), dev.put(alen), dev.put(pre))
    _eq(kd, k, "k_cache")
    _eq(vd, v, "v_cache")


def test_compact_kv_invalid_request_untouched(dev):
    k = dev.put(torch.randn(2, 3, 20, 2, 4))
    v = dev.put(torch.randn(2, 3, 20, 2, 4))
    k0, v0 = k.clone(), v.clone()
    path = torch.tensor([[0, 2, 3], [1, 2, 3], [0, 3, 3]])  # requests 1 and 2 are invalid
    dev.ops.compact_kv_(k, v, dev.put(path), dev.put(torch.tensor([2, 2, 2])), dev.put(torch.tensor([1, 1, 1])))
    _eq(k[:, 1:], k0[:, 1:], "invalid requests untouched (k)")
    _eq(v[:, 1:], v0[:, 1:], "invalid requests untouched (v)")
    _eq(k[:, 0, 2], k0[:, 0, 3], "valid request moved")


# ---------------------------------------------------------------------------------------------
# No host synchronisation; CUDA-graph capture; memory safety on inputs the CPU op rejects.
# ---------------------------------------------------------------------------------------------
def _one_round(B=4, T=16, C=60, V=2000):
    g = _gen(17)
    logits = torch.randn(B * 8, V, generator=g).to(torch.bfloat16).cuda()
    scores, parents = random_candidates(B, C, gen=g)
    scores, parents = scores.cuda(), parents.cuda()
    budgets = torch.full((B,), T - 1, dtype=torch.int64, device="cuda")
    prefix = torch.randint(0, 50, (B,), generator=g).cuda()
    target = torch.randint(0, V, (B, T), generator=g).cuda()
    probs = torch.rand(B, T, V, generator=g).cuda()
    coins = torch.rand(B, T, generator=g).cuda()
    final = torch.rand(B, generator=g).cuda()
    kc = torch.randn(2, B, 128, 2, 8, device="cuda")
    vc = torch.randn(2, B, 128, 2, 8, device="cuda")
    edges = torch.tensor([0.5, 1.5], device="cuda")
    table = torch.tensor([0, 1, 2], device="cuda")

    def run():
        lp, ids, h = hs.topk_entropy(logits, 8, None)
        hs.entropy_bin_policy(h[:B].contiguous(), edges, table, table)
        cand, tpar, n = hs.select_tree_nodes(scores, parents, budgets, T - 1)
        mask, pos, fc, ns = hs.build_tree(tpar, n, prefix)
        hs.tree_attention_mask(mask, n, prefix, 1000)
        hs.dense_tree_attention_mask(mask, prefix, 64 + T)
        toks = torch.where(cand >= 0, cand, 0)
        path, alen, bonus = hs.verify_greedy(toks, target, fc, ns, n)
        hs.verify_sampling(toks, probs, fc, ns, n, coins, final)
        hs.compact_kv_(kc, vc, path, alen, prefix)
        return bonus

    return run


def test_no_host_sync(dev):
    _cuda_only(dev)
    run = _one_round()
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_cuda_graph_capture(dev):
    _cuda_only(dev)
    run = _one_round()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = run().clone()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    _eq(out, eager, "graph replay vs eager")


def test_invalid_inputs_are_memory_safe(dev):
    """Inputs the CPU ops reject: the kernels must finish without faults."""
    g = _gen(23)
    B, T = 3, 8
    ops, put = dev.ops, dev.put
    bad_par = put(torch.randint(-3, 12, (B, T), generator=g))  # cycles, forward links
    n = put(torch.tensor([0, 8, 99]))  # out of range
    pre = put(torch.tensor([-5, 0, 3]))
    mask, pos, fc, ns = ops.build_tree(bad_par, n, pre)
    ops.tree_attention_mask(mask, n, pre, 50)
    ops.dense_tree_attention_mask(mask, pre, T + 3)
    junk = put(torch.randint(-3, 12, (B, T), generator=g))
    ops.verify_greedy(junk, junk, junk, junk, n)
    ops.verify_sampling(junk, put(torch.rand(B, T, 5)), junk, junk, n, put(torch.rand(B, T)), put(torch.rand(B)))
    scores = torch.randn(B, 20, generator=g)
    scores[0, 3] = math.nan
    ops.select_tree_nodes(put(scores), put(torch.randint(-4, 30, (B, 20), generator=g)),
                          put(torch.tensor([-1, 5, 100])), 6)
    kc = put(torch.randn(1, B, 10, 1, 4))
    ops.compact_kv_(kc, kc.clone(), junk, put(torch.tensor([3, -1, 50])), pre)
    if dev.name == "cuda":
        torch.cuda.synchronize()
