"""What the rest of a heterospec call costs besides its prefill and target steps (53rd session):
the host time of the policy's, the lookup gate's and the batch's bookkeeping per call, shipped
heterospec next to autoregressive (which shares only the compaction):
    [SAME_PROMPTS=1] python bench/results/cpu-amx-s53/rest_parts.py float32 16 6
(SAME_PROMPTS: every call the first B prompts, as batch-sweep calls)
"""
import os, sys, time, statistics
import heterospec.policy as HP, heterospec.lookup as HL, heterospec.engine as HE
from heterospec.bench import bench_call
from _setup import benchmark_prompts, engine
dtype, B, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = engine(dtype)
ps = benchmark_prompts()
acc = {}
def timed(owner, name, label=None):
    fn = getattr(owner, name)
    label = label or name
    def wrap(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[label] = acc.get(label, 0.0) + time.perf_counter() - t
    setattr(owner, name, wrap)
for owner, name in [(HP.FittedPolicy, "round_plan"), (HP.FittedPolicy, "observe"), (HP.FittedPolicy, "save_state"),
                    (HP.FittedPolicy, "new_requests"), (HP.FittedPolicy, "needs_draft"), (HP.FittedPolicy, "fitted_plan"),
                    (HL.LookupGate, "observe_plain"), (HL.LookupGate, "save"), (HE._Batch, "drop_finished"),
                    (HE.Engine, "_lookup_choice"), (HE.Engine, "_policy"), (HE.Engine, "_prefill"), (HE.Engine, "_decode_one")]:
    timed(owner, name)
arms = {"ar": dict(method="autoregressive"), "hs": bench_call("heterospec")}
for kw in arms.values():
    eng.generate_batch(ps[:B], max_new_tokens=96, **kw)
rows = {k: [] for k in arms}
for i in range(calls):
    batch = ps[:B] if os.environ.get("SAME_PROMPTS") else [ps[(i * B + j) % len(ps)] for j in range(B)]
    for k in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
        acc.clear()
        t = time.perf_counter()
        eng.generate_batch(batch, max_new_tokens=96, **arms[k])
        acc["wall"] = time.perf_counter() - t
        acc["loop rest"] = acc["wall"] - acc["_prefill"] - acc["_decode_one"] - sum(
            v for n, v in acc.items() if n not in ("wall", "_prefill", "_decode_one", "fitted_plan"))
        rows[k].append(dict(acc))
names = sorted({n for r in rows["hs"] for n in r} | {n for r in rows["ar"] for n in r})
print("B=%d %s, ms per call (median of %d calls): name  ar  heterospec" % (B, dtype, calls))
for n in names:
    a = statistics.median(r.get(n, 0.0) for r in rows["ar"]) * 1e3
    h = statistics.median(r.get(n, 0.0) for r in rows["hs"]) * 1e3
    print("  %-14s %8.1f %8.1f" % (n, a, h))
