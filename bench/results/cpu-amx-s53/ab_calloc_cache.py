"""KV caches from calloc (kv_cache.cpu_zeros) against torch.zeros, A/B per call (53rd session):
autoregressive and heterospec, each with both allocations, interleaved, the first B prompts
every call (as batch-sweep calls them):
    python bench/results/cpu-amx-s53/ab_calloc_cache.py float32 16 6
"""
import sys, time, statistics
import torch
import heterospec.models.kv_cache as KV
from heterospec.bench import bench_call
from _setup import benchmark_prompts, engine
dtype, B, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = engine(dtype)
ps = benchmark_prompts()[:B]
calloc = KV.cpu_zeros
stock = lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device)
arms = {"ar-zeros": ("autoregressive", stock), "ar-calloc": ("autoregressive", calloc),
        "hs-zeros": ("heterospec", stock), "hs-calloc": ("heterospec", calloc)}
for m, z in arms.values():
    KV.cpu_zeros = z
    eng.generate_batch(ps, max_new_tokens=96, **bench_call(m))
walls = {k: [] for k in arms}
for i in range(calls):
    for k in list(arms)[i % 4:] + list(arms)[:i % 4]:
        m, KV.cpu_zeros = arms[k]
        t = time.perf_counter()
        eng.generate_batch(ps, max_new_tokens=96, **bench_call(m))
        walls[k].append(time.perf_counter() - t)
KV.cpu_zeros = calloc
med = {k: statistics.median(v) for k, v in walls.items()}
print("B=%d %s median call: %s" % (B, dtype, {k: round(v, 4) for k, v in med.items()}))
for a, b in (("ar-zeros", "ar-calloc"), ("hs-zeros", "hs-calloc"), ("hs-zeros", "ar-zeros"), ("hs-calloc", "ar-calloc")):
    r = [x / y for x, y in zip(walls[a], walls[b])]
    print("  %s / %s: median %.4f (range %.3f-%.3f)" % (a, b, statistics.median(r), min(r), max(r)))
