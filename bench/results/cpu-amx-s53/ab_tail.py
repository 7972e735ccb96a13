"""A static batch's tail, A/B (53rd session): the new engine (finished rows dropped where the cost
model says the copy pays; time corrections against the round's own batch size; a bucket's
round-time correction its plain one until rounds were timed) against one with the old rules
(the 52nd session's, plus the timed probes of 5d14771), two engines from the same fresh online
state, each running autoregressive and heterospec, interleaved per call, prompts cycling:
    python bench/results/cpu-amx-s53/ab_tail.py float32 16 8
"""
import glob, os, sys, time, statistics
import heterospec.policy as HP
from heterospec.bench import bench_call
from heterospec.engine import COMPACT_MIN_LEFT
from heterospec.policy import FittedPolicy
from _setup import benchmark_prompts, engine
dtype, B, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for f in glob.glob(os.path.expanduser("~/.cache/heterospec/costs/*.online-*.json")):
    os.remove(f)
new, old = engine(dtype), engine(dtype)
old._compaction_pays = lambda rows, running, left: (running < rows and left >= COMPACT_MIN_LEFT
                                                    and FittedPolicy.bucket(running) < FittedPolicy.bucket(rows))
pol = old._policy("heterospec", old.config, "fitted")
observe = HP.FittedPolicy.observe
pol.observe = lambda *a, batch_size=None, **k: observe(pol, *a, **k)
pol.time_scale = lambda b: HP.FittedPolicy._time_ratio(pol, pol._time, pol._time_used, b)
ps = benchmark_prompts()
arms = {"ar-new": (new, "autoregressive"), "hs-new": (new, "heterospec"),
        "ar-old": (old, "autoregressive"), "hs-old": (old, "heterospec")}
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
print("  heterospec / AR speed, new:", ratio("ar-new", "hs-new"), " old:", ratio("ar-old", "hs-old"))
