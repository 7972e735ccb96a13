"""GPU microbenchmarks of heterospec's CUDA kernels (skipped without a GPU + CUDA build).

    python -m pytest bench/bench_ops_cuda.py --benchmark-only -s     # on the GPU host
    python -m pytest bench/bench_ops_cuda.py --benchmark-disable     # as tests (one call each)

Two figures per op:
  * GPU time per call (``gpu_us``, printed and stored in the benchmark's ``extra_info``): many
    calls captured in one CUDA graph and replayed, timed with CUDA events, so launch overhead and
    host-side Python do not count. A failed capture fails the benchmark (an eager loop would
    silently add launch gaps to the figure); ``HETEROSPEC_BENCH_ALLOW_EAGER=1`` times an eager loop
    instead and labels the figure ``timing=eager`` in the output and ``extra_info``;
  * pytest-benchmark's wall-clock time of one eager call plus ``torch.cuda.synchronize()``
    (what a Python caller sees, including dispatch and launch latency).
topk_entropy also reports achieved bandwidth: logits bytes read / GPU time, against the device's
peak HBM bandwidth (HBM_PEAK: H200 4.8 TB/s, H100 SXM 3.35 TB/s, ...). Its inputs rotate over
enough buffers to exceed the 50 MB L2, so every call reads
HBM ("cold"); the "warm" figure re-reads one buffer (L2-resident for [64, 128256] bf16).
Tree / verify ops: a batch of 8 trees of 64 nodes (EAGLE-like: top-k 8, 456 candidates),
prefix 1024, Llama-3-8B-like KV cache (32 layers, 8 KV heads x 128, bf16).
"""

import math
import os

import pytest
import torch

import heterospec  # noqa: F401  (loads the extension)

hs = torch.ops.heterospec
HBM_BYTES_PER_S = 3.35e12  # H100 SXM (HBM3): the default when the device is not in HBM_PEAK
# Peak HBM bandwidth by device-name fragment (first match; the H200 read 0.56 TB/s as 17 % of an
# H100's peak before this table existed: its own peak is 4.8 TB/s).
HBM_PEAK = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100", 2.0e12))


def hbm_peak(device_name: str) -> float:
    return next((bw for frag, bw in HBM_PEAK if frag in device_name), HBM_BYTES_PER_S)
L2_BYTES = 50 * 2**20


def _has_cuda_kernels() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("heterospec::topk_entropy", "CUDA")
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _has_cuda_kernels(), reason="needs a GPU and heterospec built with CUDA")


_TIMING = {"mode": "graph"}   # "eager" once any gpu_us call since the last _report timed an eager loop


def gpu_us(fn, iters: int = 20, reps: int = 10) -> float:
    """GPU microseconds per call of `fn` (CUDA-graph replay of `iters` calls, `reps` replays).

    A capture failure fails the benchmark unless HETEROSPEC_BENCH_ALLOW_EAGER=1 (then an eager
    loop is timed and the result is labelled ``timing=eager``)."""
    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        run = graph.replay
    except Exception as exc:
        if os.environ.get("HETEROSPEC_BENCH_ALLOW_EAGER") != "1":
            pytest.fail(f"CUDA graph capture failed ({type(exc).__name__}: {exc}); the GPU time would include "
                        "launch gaps. Fix the capture, or set HETEROSPEC_BENCH_ALLOW_EAGER=1 to time an eager "
                        "loop (labelled timing=eager)")
        print(f"\n[bench_ops_cuda] WARNING: CUDA graph capture failed ({exc}); timing an EAGER loop "
              "(launch gaps included)")
        _TIMING["mode"] = "eager"

        def run():
            for _ in range(iters):
                fn()

    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * iters)


def _wall(benchmark, fn):
    def call():
        out = fn()
        torch.cuda.synchronize()
        return out

    return benchmark(call)


def _report(benchmark, name, us, **extra):
    extra = {"timing": _TIMING["mode"], **extra}
    _TIMING["mode"] = "graph"
    benchmark.extra_info.update({"gpu_us": round(us, 2), "device": torch.cuda.get_device_name(), **extra})
    more = "  ".join(f"{k}={v}" for k, v in extra.items())
    print(f"\n[bench_ops_cuda] {name}: {us:.2f} us/call (GPU)  {more}")


# ---------------------------------------------------------------------------------------------
# topk_entropy: achieved bandwidth
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("M,V,dtype,k", [(64, 128256, torch.bfloat16, 8), (64, 128256, torch.bfloat16, 64),
                                         (64, 128256, torch.float32, 8), (64, 32000, torch.bfloat16, 8),
                                         (512, 128256, torch.bfloat16, 8)])
def test_topk_entropy_bandwidth(benchmark, M, V, dtype, k):
    row_bytes = V * torch.finfo(dtype).bits // 8
    nbuf = max(1, math.ceil(3 * L2_BYTES / (M * row_bytes)))
    bufs = [(torch.randn(M, V, device="cuda") * 3).to(dtype) for _ in range(nbuf)]
    parent = torch.rand(M, device="cuda")
    i = [0]

    def cold():
        i[0] = (i[0] + 1) % nbuf
        return hs.topk_entropy(bufs[i[0]], k, parent)

    def warm():
        return hs.topk_entropy(bufs[0], k, parent)

    nbytes = M * row_bytes
    # Calls rotate over the buffers inside the captured graph too (iters is a multiple of nbuf).
    us_cold = gpu_us(cold, iters=nbuf * max(1, 20 // nbuf))
    us_warm = gpu_us(warm)
    bw = nbytes / (us_cold * 1e-6)

    def composite():  # what one would write in PyTorch: log_softmax + topk + entropy
        lp = torch.log_softmax(bufs[0].float(), -1)
        vals, ids = lp.topk(k, -1)
        q = torch.softmax(vals, -1)
        return vals, ids, -(q * torch.log(q.clamp_min(1e-30))).sum(-1) + parent

    us_torch = gpu_us(composite, iters=5)
    _report(benchmark, f"topk_entropy [{M}, {V}] {dtype} k={k}", us_cold, bytes=nbytes,
            TBps=round(bw / 1e12, 3), hbm_fraction=round(bw / hbm_peak(torch.cuda.get_device_name()), 3),
            warm_us=round(us_warm, 2),
            torch_composite_us=round(us_torch, 2))
    _wall(benchmark, warm)


# ---------------------------------------------------------------------------------------------
# Tree / verify ops: 8 trees of 64 nodes
# ---------------------------------------------------------------------------------------------
B, T, TOPK, DEPTH, PREFIX, V = 8, 64, 8, 8, 1024, 128256


def _eagle_candidates(gen):
    """Scores / parents of an EAGLE-like expansion: top-k children of the root, then top-k^2 per
    layer from the k best of the previous layer (C = k + (depth - 1) k^2)."""
    scores, parents = [], []
    layer = torch.log(torch.rand(B, TOPK, generator=gen, device="cuda")).sort(-1, descending=True).values
    scores.append(layer)
    parents.append(torch.full((B, TOPK), -1, device="cuda", dtype=torch.int64))
    offset = 0
    for _ in range(DEPTH - 1):
        best = layer.topk(TOPK, -1).indices  # frontier within the layer
        base = torch.gather(layer, 1, best)
        child = base[:, :, None] + torch.log(torch.rand(B, TOPK, TOPK, generator=gen, device="cuda"))
        parents.append((offset + best)[:, :, None].expand(B, TOPK, TOPK).reshape(B, -1))
        offset += layer.shape[1]
        layer = child.reshape(B, -1)
        scores.append(layer)
    return torch.cat(scores, 1).float().contiguous(), torch.cat(parents, 1).contiguous()


@pytest.fixture(scope="module")
def tree_batch():
    gen = torch.Generator(device="cuda").manual_seed(0)
    scores, parents = _eagle_candidates(gen)
    budgets = torch.full((B,), T - 1, device="cuda", dtype=torch.int64)
    prefix = torch.full((B,), PREFIX, device="cuda", dtype=torch.int64)
    cand, tpar, n = hs.select_tree_nodes(scores, parents, budgets, T - 1)
    mask, pos, fc, ns = hs.build_tree(tpar, n, prefix)
    tokens = torch.randint(0, V, (B, T), generator=gen, device="cuda")
    # the target "predicts" each node's first child: greedy accepts along the first-child chains
    target_ids = torch.where(fc >= 0, tokens.gather(1, fc.clamp_min(0)), tokens)
    probs = torch.softmax(torch.randn(B, T, V, generator=gen, device="cuda") * 3, -1)
    coins = torch.rand(B, T, generator=gen, device="cuda")
    final = torch.rand(B, generator=gen, device="cuda")
    kc = torch.randn(32, B, 2 * PREFIX, 8, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    numel = int((n * (prefix + n)).sum())
    # entropy_bin_policy inputs: built here, never inside the timed (captured) call
    path_h = (torch.rand(B, generator=gen, device="cuda") * 1.2).contiguous()
    edges = torch.tensor([0.3, 0.6], device="cuda")
    ext = torch.tensor([0, 1, 2], device="cuda")
    budget = torch.tensor([16, 32, 63], device="cuda")
    return dict(scores=scores, parents=parents, budgets=budgets, prefix=prefix, tpar=tpar, n=n, mask=mask, fc=fc,
                ns=ns, tokens=tokens, target_ids=target_ids, probs=probs, coins=coins, final=final, kc=kc, vc=vc,
                numel=numel, path_h=path_h, edges=edges, ext=ext, budget=budget)


def _tree_case(t, name):
    alen_path = hs.verify_greedy(t["tokens"], t["target_ids"], t["fc"], t["ns"], t["n"])
    return {
        "select_tree_nodes": lambda: hs.select_tree_nodes(t["scores"], t["parents"], t["budgets"], T - 1),
        "build_tree": lambda: hs.build_tree(t["tpar"], t["n"], t["prefix"]),
        "tree_attention_mask": lambda: hs.tree_attention_mask(t["mask"], t["n"], t["prefix"], t["numel"]),
        "dense_tree_attention_mask": lambda: hs.dense_tree_attention_mask(t["mask"], t["prefix"], 2 * PREFIX),
        "verify_greedy": lambda: hs.verify_greedy(t["tokens"], t["target_ids"], t["fc"], t["ns"], t["n"]),
        "verify_sampling": lambda: hs.verify_sampling(t["tokens"], t["probs"], t["fc"], t["ns"], t["n"], t["coins"],
                                                      t["final"]),
        "compact_kv_": lambda: hs.compact_kv_(t["kc"], t["vc"], alen_path[0], alen_path[1], t["prefix"]),
        "entropy_bin_policy": lambda: hs.entropy_bin_policy(t["path_h"], t["edges"], t["ext"], t["budget"]),
    }[name]


@pytest.mark.parametrize("name", ["select_tree_nodes", "build_tree", "tree_attention_mask",
                                  "dense_tree_attention_mask", "verify_greedy", "verify_sampling", "compact_kv_",
                                  "entropy_bin_policy"])
def test_tree_op_latency(benchmark, tree_batch, name):
    fn = _tree_case(tree_batch, name)
    us = gpu_us(fn)
    extra = {"B": B, "T": T}
    if name == "select_tree_nodes":
        extra["C"] = tree_batch["scores"].shape[1]
    if name == "compact_kv_":
        extra["accepted_rows"] = int(hs.verify_greedy(tree_batch["tokens"], tree_batch["target_ids"], tree_batch["fc"],
                                                      tree_batch["ns"], tree_batch["n"])[1].sum())
    if name == "verify_sampling":
        extra["V"] = V
    _report(benchmark, f"{name} (8 trees x 64 nodes)", us, **extra)
    _wall(benchmark, fn)
