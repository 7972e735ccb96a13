"""Where a plainly decoded heterospec call's gap to autoregressive goes (53rd session): the time
in the prefill, in the plain steps (_decode_one) and in the rest of the loop, per call, for
autoregressive and heterospec forced plain (no lookup) and the shipped heterospec, interleaved:
    python bench/results/cpu-amx-s53/split_gap.py float32 16 6
"""
import sys, time, statistics
from heterospec import Engine
from heterospec.policy import ForcedPolicy
from _setup import benchmark_prompts, engine
dtype, B, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = engine(dtype)
ps = benchmark_prompts()
pol = ForcedPolicy(eng.tables, eng.cost_model, eng.config, speculate=False, ragged=eng.ragged_verify)
from heterospec.bench import bench_call
arms = {"ar": dict(method="autoregressive"), "plain": dict(method="heterospec", policy=pol, lookup=False),
        "shipped": bench_call("heterospec")}
others = {"plain": 0, "shipped": 0}
acc = {}
def timed(name, fn):
    def wrap(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
    return wrap
eng._prefill = timed("prefill", eng._prefill)
eng._decode_one = timed("steps", eng._decode_one)
for kw in arms.values():
    eng.generate_batch(ps[:B], max_new_tokens=96, **kw)
rows = {k: [] for k in arms}
for i in range(calls):
    batch = [ps[(i * B + j) % len(ps)] for j in range(B)]
    for k in list(arms)[i % 3:] + list(arms)[:i % 3]:
        acc.clear()
        t = time.perf_counter()
        res = eng.generate_batch(batch, max_new_tokens=96, **arms[k])
        w = time.perf_counter() - t
        if k in others:
            others[k] += sum(not r.plain for x in res for r in x.stats.records)
        rows[k].append((w, acc["prefill"], acc["steps"], w - acc["prefill"] - acc["steps"]))
print("B=%d non-plain rounds (request-rounds):" % B, others)
for arm in ("plain", "shipped"):
    for j, name in enumerate(("wall", "prefill", "steps", "rest")):
        d = [1e3 * (p[j] - a[j]) for a, p in zip(rows["ar"], rows[arm])]
        print("B=%d %s %-8s ar %8.1f ms  %s-ar median %+7.1f ms (range %+.1f..%+.1f)" % (
            B, dtype, name, 1e3 * statistics.median(a[j] for a in rows["ar"]), arm, statistics.median(d), min(d), max(d)))
