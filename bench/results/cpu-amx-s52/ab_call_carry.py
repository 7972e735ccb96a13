"""A/B of the guard's per-call re-judging at batch B (52nd session): autoregressive, heterospec
with CALL_REJUDGE 0.5 (new) and 0 (old: every call re-judged down to CALL_CARRY * B rounds),
interleaved per call in rotating order, each policy fresh (no saved online state), own engines:
    python bench/results/cpu-amx-s52/ab_call_carry.py float32 2 12
It needs the change it judged (tried, not kept): in FittedPolicy.new_requests, cap the carried
rounds only where `cap <= (1 - CALL_REJUDGE) * MIN_REALIZED[0]`, with CALL_REJUDGE = 0.5. On the
shipped code both policies are the same.
"""
import sys, time, statistics
from heterospec.policy import FittedPolicy
from _setup import benchmark_prompts, engine
dtype, B, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engs = {k: engine(dtype) for k in ("new", "old")}
pols = {}
for k, e in engs.items():
    cfg = e.config
    pols[k] = FittedPolicy(e.tables_for(cfg.top_k), e.cost_model, cfg, ragged=e.ragged_verify)
pols["old"].CALL_REJUDGE = 0.0
prompts = benchmark_prompts()
runs = {"ar": lambda ps: engs["new"].generate_batch(ps, max_new_tokens=96, method="autoregressive"),
        "new": lambda ps: engs["new"].generate_batch(ps, max_new_tokens=96, method="heterospec", policy=pols["new"]),
        "old": lambda ps: engs["old"].generate_batch(ps, max_new_tokens=96, method="heterospec", policy=pols["old"])}
order = list(runs)
walls = {k: [] for k in runs}
for i in range(calls):
    ps = [prompts[(i * B + j) % len(prompts)] for j in range(B)]
    outs, kinds = {}, {}
    for k in order[i % 3:] + order[:i % 3]:
        t = time.perf_counter(); res = runs[k](ps); walls[k].append(time.perf_counter() - t)
        outs[k] = [r.token_ids for r in res]
        if k != "ar":
            rec = [r for x in res for r in x.stats.records]
            kinds[k] = "p%d l%d s%d" % (sum(r.plain for r in rec), sum(r.lookup for r in rec),
                                        sum(not r.plain and not r.lookup for r in rec))
    assert outs["new"] == outs["ar"] == outs["old"] or dtype != "float32", "outputs differ"
    print(i, {k: round(v[-1], 3) for k, v in walls.items()}, kinds, flush=True)
for k in ("new", "old"):
    r = [a / b for a, b in zip(walls["ar"], walls[k])]
    print(k, "/ ar: median %.3f mean %.3f (calls 1..: median %.3f)" % (statistics.median(r), statistics.fmean(r), statistics.median(r[1:])))
print("ar tok/s per request: %.1f" % (96 / statistics.median(walls["ar"])))
