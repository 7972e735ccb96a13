"""Microbenchmarks: each heterospec op vs the PyTorch code one would write without it.

    python -m pytest bench/bench_ops.py --benchmark-only --benchmark-group-by=group    # measure
    python -m pytest bench/bench_ops.py --benchmark-disable                             # as tests (CI)

Baselines: a vectorised PyTorch composite where one exists (topk_entropy, entropy_bin_policy,
build_tree's mask, dense_tree_attention_mask, compact_kv_), otherwise the per-request PyTorch
reference from tests/reference (select_tree_nodes, tree_attention_mask, verify_*). Every benchmark
first checks that both sides agree, so the file doubles as a test. Figures: bench/RESULTS.md.
"""

import math

import pytest
import torch

import heterospec.ops as ops
from reference import (
    build_tree_ref,
    select_tree_nodes_ref,
    tree_attention_mask_ref,
    verify_greedy_ref,
    verify_sampling_ref,
)
from reference.samples import random_candidates

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _run(benchmark, device, fn, *args):
    def call():
        out = fn(*args)
        _sync(device)
        return out

    return benchmark(call)


# ---------------------------------------------------------------- composites
def topk_entropy_composite(logits, k):
    """log_softmax + topk + entropy of the renormalised top-k (three [M, V] passes + temporaries)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = lp.topk(k, dim=-1)
    q = torch.softmax(vals, dim=-1)
    h = -(q * torch.log(q.clamp_min(1e-30))).sum(-1)
    return vals, ids, h


def entropy_bin_policy_composite(h, edges, depth, budget):
    bins = torch.searchsorted(edges, h.contiguous(), right=False)
    bins = torch.where(torch.isnan(h), edges.numel(), bins)
    return bins, depth[bins], budget[bins]


def tree_mask_composite(tree_parents, num_nodes):
    """Ancestor mask by pointer doubling: log2(T) boolean matrix products."""
    B, T = tree_parents.shape
    idx = torch.arange(T, device=tree_parents.device)
    real = idx[None, :] < num_nodes[:, None]
    par = torch.where(real & (idx[None, :] > 0), tree_parents, idx[None, :]).clamp(0, T - 1)
    reach = torch.zeros(B, T, T, device=tree_parents.device)
    reach.scatter_(2, par[..., None], 1.0)
    reach = torch.maximum(reach, torch.eye(T, device=tree_parents.device))
    for _ in range(max(1, math.ceil(math.log2(T)))):
        reach = (reach @ reach).clamp_max(1.0)
    mask = reach.bool() & real[:, None, :] & real[:, :, None]
    return mask | torch.eye(T, dtype=torch.bool, device=tree_parents.device)


def dense_mask_composite(tree_mask, prefix_lens, width):
    B, T, _ = tree_mask.shape
    cols = torch.arange(width, device=tree_mask.device)
    out = cols[None, None, :] < prefix_lens[:, None, None]
    out = out.expand(B, T, width).clone()
    tree_cols = (prefix_lens[:, None] + torch.arange(T, device=tree_mask.device)[None, :])  # [B, T]
    out.scatter_(2, tree_cols[:, None, :].expand(B, T, T), tree_mask)
    return out


def compact_kv_composite(k, v, accept_path, accept_len, prefix_lens):
    P = accept_path.shape[1]
    i = torch.arange(P, device=k.device)
    keep = i[None, :] <= accept_len[:, None]  # [B, P]
    b_idx = torch.arange(k.shape[1], device=k.device)[:, None].expand_as(accept_path)[keep]
    dst = (prefix_lens[:, None] + i[None, :])[keep]
    src = (prefix_lens[:, None] + accept_path)[keep]
    for cache in (k, v):
        cache[:, b_idx, dst] = cache[:, b_idx, src]  # advanced-index gather happens before the write


# ---------------------------------------------------------------- inputs
def _tree_inputs(B=16, C=392, max_nodes=63, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores, parents = random_candidates(B, C, mode="monotone", p_neg_inf=0.02, gen=g)
    budgets = torch.full((B,), max_nodes, dtype=torch.int64)
    _, tree_parents, num_nodes = ops.select_tree_nodes(scores, parents, budgets, max_nodes)
    prefix_lens = torch.randint(100, 400, (B,), generator=g)
    return scores, parents, budgets, tree_parents, num_nodes, prefix_lens


# ---------------------------------------------------------------- benchmarks
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["fused", "composite"])
def test_bench_topk_entropy(benchmark, device, dtype, impl):
    """[64, 49152] (a 64-node draft tree over a 49152-token draft vocabulary), k = 8."""
    benchmark.group = f"topk_entropy [64, 49152] {dtype} {device}"
    logits = (torch.randn(64, 49152) * 3).to(dtype).to(device)
    fused = ops.topk_entropy(logits, 8)
    comp = topk_entropy_composite(logits, 8)
    # Same selected values (torch.topk breaks ties in no particular order; ours by lower id).
    assert torch.equal(logits.gather(1, fused[1]), logits.gather(1, comp[1]))
    torch.testing.assert_close(fused[0], comp[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fused[2], comp[2], rtol=1e-4, atol=1e-4)
    fn = ops.topk_entropy if impl == "fused" else topk_entropy_composite
    _run(benchmark, device, fn, logits, 8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fused", "composite"])
def test_bench_entropy_bin_policy(benchmark, device, impl):
    benchmark.group = f"entropy_bin_policy B=64 {device}"
    h = (torch.rand(64) * 5).to(device)
    args = (h, torch.tensor([0.8, 1.6, 2.4], device=device), torch.tensor([3, 2, 1, 0], device=device),
            torch.tensor([80, 60, 50, 40], device=device))
    for a, b in zip(ops.entropy_bin_policy(*args), entropy_bin_policy_composite(*args)):
        assert torch.equal(a, b)
    _run(benchmark, device, ops.entropy_bin_policy if impl == "fused" else entropy_bin_policy_composite, *args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_bench_select_tree_nodes(benchmark, device, impl):
    benchmark.group = f"select_tree_nodes B=16 C=392 N=63 {device}"
    scores, parents, budgets, *_ = _tree_inputs()
    args = (scores.to(device), parents.to(device), budgets.to(device), 63)
    if impl == "fused":
        ref = select_tree_nodes_ref(*args)
        for a, b in zip(ops.select_tree_nodes(*args), ref):
            assert torch.equal(a.cpu(), b)
    _run(benchmark, device, ops.select_tree_nodes if impl == "fused" else select_tree_nodes_ref, *args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fused", "composite", "reference"])
def test_bench_build_tree(benchmark, device, impl):
    benchmark.group = f"build_tree B=16 T=64 {device}"
    *_, tree_parents, num_nodes, prefix_lens = _tree_inputs()
    args = (tree_parents.to(device), num_nodes.to(device), prefix_lens.to(device))
    fused = ops.build_tree(*args)
    assert torch.equal(fused[0], tree_mask_composite(*args[:2]))
    fn = {"fused": ops.build_tree, "reference": build_tree_ref}.get(impl)
    if impl == "composite":
        _run(benchmark, device, tree_mask_composite, *args[:2])
    else:
        _run(benchmark, device, fn, *args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_bench_tree_attention_mask(benchmark, device, impl):
    benchmark.group = f"tree_attention_mask B=16 T=64 {device}"
    *_, tree_parents, num_nodes, prefix_lens = _tree_inputs()
    tree_mask = ops.build_tree(tree_parents, num_nodes, prefix_lens)[0]
    numel = int((num_nodes * (prefix_lens + num_nodes)).sum())
    args = (tree_mask.to(device), num_nodes.to(device), prefix_lens.to(device))
    fused = ops.tree_attention_mask(*args, numel)
    ref = tree_attention_mask_ref(*args)
    assert torch.equal(fused[0].cpu(), ref[0]) and torch.equal(fused[1].cpu(), ref[1])
    if impl == "fused":
        _run(benchmark, device, ops.tree_attention_mask, *args, numel)
    else:
        _run(benchmark, device, tree_attention_mask_ref, *args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fused", "composite"])
def test_bench_dense_tree_attention_mask(benchmark, device, impl):
    benchmark.group = f"dense_tree_attention_mask B=16 T=64 W=512 {device}"
    *_, tree_parents, num_nodes, prefix_lens = _tree_inputs()
    tree_mask = ops.build_tree(tree_parents, num_nodes, prefix_lens)[0]
    args = (tree_mask.to(device), prefix_lens.to(device), 512)
    assert torch.equal(ops.dense_tree_attention_mask(*args), dense_mask_composite(*args))
    _run(benchmark, device, ops.dense_tree_attention_mask if impl == "fused" else dense_mask_composite, *args)


def _verify_inputs(device, V=32000, seed=0):
    *_, tree_parents, num_nodes, prefix_lens = _tree_inputs(seed=seed)
    _, _, fc, ns = ops.build_tree(tree_parents, num_nodes, prefix_lens)
    B, T = tree_parents.shape
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4, (B, T), generator=g)  # tiny alphabet: long accepted paths
    target = torch.randint(0, 4, (B, T), generator=g)
    return [t.to(device) for t in (tokens, target, fc, ns, num_nodes)], V, g


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_bench_verify_greedy(benchmark, device, impl):
    benchmark.group = f"verify_greedy B=16 T=64 {device}"
    args, _, _ = _verify_inputs(device)
    for a, b in zip(ops.verify_greedy(*args), verify_greedy_ref(*args)):
        assert torch.equal(a.cpu(), b)
    _run(benchmark, device, ops.verify_greedy if impl == "fused" else verify_greedy_ref, *args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_bench_verify_sampling(benchmark, device, impl):
    """B=4 requests, T=64 nodes, V=32000 target probabilities."""
    benchmark.group = f"verify_sampling B=4 T=64 V=32000 {device}"
    (tokens, _, fc, ns, num_nodes), V, g = _verify_inputs(device)
    B = 4
    T = tokens.shape[1]
    probs = torch.softmax(torch.randn(B, T, V, generator=g) * 2, -1)
    probs[..., :4] += 0.2  # the tree's tokens are likely: long paths
    args = [tokens[:B], probs.to(device), fc[:B], ns[:B], num_nodes[:B],
            torch.rand(B, T, generator=g).to(device), torch.rand(B, generator=g).to(device)]
    for a, b in zip(ops.verify_sampling(*args), verify_sampling_ref(*args)):
        assert torch.equal(a.cpu(), b)
    _run(benchmark, device, ops.verify_sampling if impl == "fused" else verify_sampling_ref, *args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fused", "composite"])
def test_bench_compact_kv(benchmark, device, impl):
    """A 1B-class layer stack: 16 layers, B=16, S=1024, 8 KV heads x 64, bf16; ~6 accepted each."""
    benchmark.group = f"compact_kv_ L=16 B=16 S=1024 H=8 D=64 bf16 {device}"
    NL, B, S, H, D, P = 16, 16, 1024, 8, 64, 64
    g = torch.Generator().manual_seed(0)
    k = torch.randn(NL, B, S, H, D, generator=g).bfloat16().to(device)
    v = torch.randn(NL, B, S, H, D, generator=g).bfloat16().to(device)
    accept_len = torch.randint(3, 9, (B,), generator=g)
    accept_path = torch.full((B, P), -1, dtype=torch.int64)
    for b in range(B):
        steps = torch.randint(1, 6, (int(accept_len[b]),), generator=g)
        accept_path[b, : int(accept_len[b]) + 1] = torch.cat([torch.zeros(1, dtype=torch.int64), steps.cumsum(0)])
    prefix_lens = torch.randint(100, 800, (B,), generator=g)
    args = [t.to(device) for t in (accept_path, accept_len, prefix_lens)]
    k2, v2 = k.clone(), v.clone()
    ops.compact_kv_(k, v, *args)
    compact_kv_composite(k2, v2, *args)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    fn = ops.compact_kv_ if impl == "fused" else compact_kv_composite
    _run(benchmark, device, fn, k, v, *args)  # repeated calls move rows within the same caches


@pytest.mark.parametrize("impl", ["fused", "composite"])
@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_bench_sample_tokens(benchmark, impl, top_p):
    """The keyed draw of a 4-node sampled tree's rows (4 x 49,152 float32 logits, temperature
    0.8): the op against processed_probs then sample_rows (CPU only: a GPU takes the composed path)."""
    from heterospec.config import SamplingParams
    from heterospec.sampling import processed_probs, sample_rows

    benchmark.group = f"sample_tokens R=4 V=49152 T=0.8 top_p={top_p} cpu"
    g = torch.Generator().manual_seed(0)
    logits, u = torch.randn(4, 49152, generator=g) * 4, torch.rand(4, generator=g, dtype=torch.float64)
    params = SamplingParams(temperature=0.8, top_p=top_p)

    def composite():
        return sample_rows(processed_probs(logits, params), u)

    def fused():
        return ops.sample_tokens(logits, u, 0.8, 0, top_p)

    assert torch.equal(fused()[0], composite()[0])
    _run(benchmark, "cpu", fused if impl == "fused" else composite)


# ---------------------------------------------------------------- interleaved speedup table
def test_topk_entropy_speedup_table():
    """Fused vs composite topk_entropy on [64, 49152], k = 8, measured interleaved (robust on a
    shared box) for 1 and 2 threads and each logits dtype. Prints a table with -s.

        HETEROSPEC_BENCH_REPS=25 python -m pytest -q -s bench/bench_ops.py -k speedup_table

    Without HETEROSPEC_BENCH_REPS it runs one repetition (a smoke test; nothing is asserted about
    timings, which would flake on shared CI machines)."""
    import os
    import statistics
    import time

    reps = int(os.environ.get("HETEROSPEC_BENCH_REPS", "1"))
    calls = 10 if reps > 1 else 1
    threads_before = torch.get_num_threads()

    def per_call(fn):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) / calls * 1e3

    rows = []
    try:
        for threads in sorted({1, threads_before}):
            torch.set_num_threads(threads)
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                x = (torch.randn(64, 49152) * 3).to(dtype)
                fused, comp = (lambda: ops.topk_entropy(x, 8)), (lambda: topk_entropy_composite(x, 8))
                fused(), comp()
                f, c = [], []
                for _ in range(reps):
                    f.append(per_call(fused))
                    c.append(per_call(comp))
                fm, cm = statistics.median(f), statistics.median(c)
                rows.append(f"| {threads} | {str(dtype)[6:]} | {fm:.2f} ms ({min(f):.2f}) | {cm:.2f} ms ({min(c):.2f}) "
                            f"| {cm / fm:.1f}x |")
    finally:
        torch.set_num_threads(threads_before)
    print("\n| threads | dtype | fused | composite | speedup (median) |\n|---|---|---|---|---|")
    print("\n".join(rows))
