"""How much of a plainly decoded heterospec call's gap to autoregressive is per-round policy
Python (52nd session): the same calls with round_plan memoised, observe and the lookup gate off
(a bound, not a product), and each of the three alone, interleaved with autoregressive and the
shipped code:
    python bench/results/cpu-amx-s52/bound_plain_overhead.py float32 8 6
"""
import sys, time, statistics
import heterospec.policy as HP, heterospec.lookup as HL
from heterospec.bench import bench_call
from _setup import benchmark_prompts, engine
dtype, B, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = engine(dtype)
prompts = benchmark_prompts()
ps = prompts[:B]
for m in ("autoregressive", "heterospec", "heterospec"):
    eng.generate_batch(ps, max_new_tokens=96, **bench_call(m))
orig = (HP.FittedPolicy.round_plan, HP.FittedPolicy.observe, HL.LookupGate.due, HL.LookupGate.observe_plain)
memo = {}
def rp(self, b, context=None, tokens_left=None, catchup=None):
    if b not in memo:
        memo[b] = orig[0](self, b, context, tokens_left, catchup)
    return memo[b]
def patch(what):
    HP.FittedPolicy.round_plan, HP.FittedPolicy.observe, HL.LookupGate.due, HL.LookupGate.observe_plain = orig
    if what in ("bound", "no-plan"):
        HP.FittedPolicy.round_plan = rp
    if what in ("bound", "no-observe"):
        HP.FittedPolicy.observe = lambda *a, **k: None
    if what in ("bound", "no-lookup"):
        HL.LookupGate.due, HL.LookupGate.observe_plain = lambda *a, **k: False, lambda *a, **k: None
walls = {"ar": [], "shipped": [], "bound": [], "no-plan": [], "no-observe": [], "no-lookup": []}
other = {}    # rounds that were not plain steps, per variant (a call with any compares less cleanly)
for i in range(calls):
    n = len(walls)
    for k in list(walls)[i % n:] + list(walls)[:i % n]:
        patch(k)
        t = time.perf_counter()
        res = eng.generate_batch(ps, max_new_tokens=96, **bench_call("autoregressive" if k == "ar" else "heterospec"))
        walls[k].append(time.perf_counter() - t)
        if k != "ar":
            other[k] = other.get(k, 0) + sum(not r.plain for x in res for r in x.stats.records)
    patch(None)
    print(i, {k: round(v[-1], 4) for k, v in walls.items()}, "non-plain rounds so far", other, flush=True)
for k in list(walls)[1:]:
    print(k, "ar / %s: median %.4f" % (k, statistics.median(a / b for a, b in zip(walls["ar"], walls[k]))))
