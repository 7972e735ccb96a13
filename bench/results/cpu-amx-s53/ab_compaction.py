"""Dropping finished rows where the cost model says the copy pays, against once per batch bucket
(the old rule), A/B (53rd session): two engines from the same fresh online state, one with the
old rule, each running autoregressive and heterospec, interleaved per call, prompts cycling
(requests end at EOS at different rounds):
    python bench/results/cpu-amx-s53/ab_compaction.py float32 16 8
"""
import glob, os, sys, time, statistics
from heterospec.bench import bench_call
from heterospec.policy import FittedPolicy
from _setup import benchmark_prompts, engine
dtype, B, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for f in glob.glob(os.path.expanduser("~/.cache/heterospec/costs/*.online-*.json")):
    os.remove(f)
new, old = engine(dtype), engine(dtype)
from heterospec.engine import COMPACT_MIN_LEFT
old._compaction_pays = lambda rows, running, left: (running < rows and left >= COMPACT_MIN_LEFT
                                                    and FittedPolicy.bucket(running) < FittedPolicy.bucket(rows))
ps = benchmark_prompts()
arms = {"ar-new": (new, "autoregressive"), "hs-new": (new, "heterospec"),
        "ar-old": (old, "autoregressive"), "hs-old": (old, "heterospec")}
for eng, m in arms.values():           # both engines load their cost model and policy first
    eng.generate_batch(ps[:2], max_new_tokens=8, **bench_call(m))
walls = {k: [] for k in arms}
spec = {k: 0 for k in arms}
for i in range(calls):
    batch = [ps[(i * B + j) % len(ps)] for j in range(B)]
    for k in list(arms)[i % 4:] + list(arms)[:i % 4]:
        eng, m = arms[k]
        t = time.perf_counter()
        res = eng.generate_batch(batch, max_new_tokens=96, **bench_call(m))
        walls[k].append(time.perf_counter() - t)
        spec[k] += sum(not r.plain and not r.lookup for x in res for r in x.stats.records)
    print(i, {k: round(v[-1], 3) for k, v in walls.items()}, "speculative request-rounds", spec, flush=True)
def ratio(a, b):
    r = [x / y for x, y in zip(walls[a], walls[b])]
    return "median %.4f, total %.4f" % (statistics.median(r), sum(walls[a]) / sum(walls[b]))
print("B=%d %s" % (B, dtype))
print("  ar-old / ar-new (time):", ratio("ar-old", "ar-new"))
print("  hs-old / hs-new (time):", ratio("hs-old", "hs-new"))
print("  heterospec / AR speed, new rule:", ratio("ar-new", "hs-new"), " old rule:", ratio("ar-old", "hs-old"))
