"""A plainly decoded heterospec call against autoregressive (53rd session): heterospec with the
fitted policy forced plain (ForcedPolicy speculate=False: cold steps, the probe schedule out of
sight), with and without context lookup, and the shipped heterospec, interleaved per call:
    python bench/results/cpu-amx-s53/plain_gap.py float32 4 8
"""
import sys, time, statistics
from heterospec.policy import ForcedPolicy
from heterospec.bench import bench_call
from _setup import benchmark_prompts, engine
dtype, B, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = engine(dtype)
ps = benchmark_prompts()
pol = ForcedPolicy(eng.tables, eng.cost_model, eng.config, speculate=False, ragged=eng.ragged_verify)
arms = {
    "ar": dict(method="autoregressive"),
    "forced-plain": dict(method="heterospec", policy=pol, lookup=False),
    "forced-plain+lookup": dict(method="heterospec", policy=pol, lookup=True),
    "shipped": bench_call("heterospec"),
}
for kw in arms.values():
    eng.generate_batch(ps[:B], max_new_tokens=96, **kw)
walls = {k: [] for k in arms}
for i in range(calls):
    batch = [ps[(i * B + j) % len(ps)] for j in range(B)]
    keys = list(arms)[i % len(arms):] + list(arms)[:i % len(arms)]
    for k in keys:
        t = time.perf_counter()
        eng.generate_batch(batch, max_new_tokens=96, **arms[k])
        walls[k].append(time.perf_counter() - t)
    print(i, {k: round(v[-1], 4) for k, v in walls.items()}, flush=True)
for k in list(arms)[1:]:
    r = sorted(a / b for a, b in zip(walls["ar"], walls[k]))
    print("B=%d %s: ar/%s median %.4f (range %.3f-%.3f)" % (B, dtype, k, statistics.median(r), r[0], r[-1]))
