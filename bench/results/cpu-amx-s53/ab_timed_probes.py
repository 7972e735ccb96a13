"""Probe bursts only in timed rounds, A/B (53rd session): two engines with their own fitted
policies from the same fresh online state, one whose round_plan ignores ``timed`` (the old
schedule), interleaved per call with autoregressive, prompts cycling:
    python bench/results/cpu-amx-s53/ab_timed_probes.py float32 16 8
"""
import glob, os, sys, time, statistics
import heterospec.policy as HP
from heterospec.bench import bench_call
from _setup import benchmark_prompts, engine
dtype, B, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for f in glob.glob(os.path.expanduser("~/.cache/heterospec/costs/*.online-*.json")):
    os.remove(f)        # a fresh online state for both engines
new, old = engine(dtype), engine(dtype)
pol_old = old._policy("heterospec", old.config, "fitted")
plain_round_plan = HP.FittedPolicy.round_plan
pol_old.round_plan = lambda *a, timed=True, **k: plain_round_plan(pol_old, *a, timed=True, **k)
ps = benchmark_prompts()
arms = {"ar": (new, dict(method="autoregressive")), "new": (new, bench_call("heterospec")),
        "old": (old, bench_call("heterospec"))}
walls = {k: [] for k in arms}
spec = {k: 0 for k in arms}
for i in range(calls):
    batch = [ps[(i * B + j) % len(ps)] for j in range(B)]
    for k in list(arms)[i % 3:] + list(arms)[:i % 3]:
        eng, kw = arms[k]
        t = time.perf_counter()
        res = eng.generate_batch(batch, max_new_tokens=96, **kw)
        walls[k].append(time.perf_counter() - t)
        spec[k] += sum(not r.plain and not r.lookup for x in res for r in x.stats.records)
    print(i, {k: round(v[-1], 3) for k, v in walls.items()}, "speculative request-rounds", spec, flush=True)
for k in ("new", "old"):
    r = [a / b for a, b in zip(walls["ar"], walls[k])]
    print("B=%d %s: %s / ar median %.4f, total-time ratio %.4f" % (B, dtype, k, statistics.median(r),
                                                                sum(walls["ar"]) / sum(walls[k])))
