"""A/B of round_plan's plain stretch (52nd session): autoregressive, heterospec with plain
stretches (PLAIN_REPLAN 8, shipped) and with a full plan every round (PLAIN_REPLAN -1), one
engine and one policy (the attribute toggled per call), interleaved in rotating order:
    python bench/results/cpu-amx-s52/ab_plain_stretch.py float32 4 12
"""
import sys, time, statistics
from heterospec.bench import bench_call
from _setup import benchmark_prompts, engine
dtype, B, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = engine(dtype)
prompts = benchmark_prompts()
for m in ("autoregressive", "heterospec", "heterospec"):
    eng.generate_batch(prompts[:B], max_new_tokens=96, **bench_call(m))
pol = next(iter(eng._fitted.values()))
walls = {"ar": [], "stretch": [], "full": []}
kinds = {"stretch": 0, "full": 0}
for i in range(calls):
    ps = [prompts[(i * B + j) % len(prompts)] for j in range(B)]
    outs = {}
    for k in list(walls)[i % 3:] + list(walls)[:i % 3]:
        pol.PLAIN_REPLAN = 8 if k == "stretch" else -1
        t = time.perf_counter()
        res = eng.generate_batch(ps, max_new_tokens=96, **bench_call("autoregressive" if k == "ar" else "heterospec"))
        walls[k].append(time.perf_counter() - t)
        outs[k] = [r.token_ids for r in res]
        if k != "ar":
            kinds[k] += sum(not r.plain for x in res for r in x.stats.records)
    assert dtype != "float32" or outs["ar"] == outs["stretch"] == outs["full"], "outputs differ"
    print(i, {k: round(v[-1], 4) for k, v in walls.items()}, "non-plain rounds so far", kinds, flush=True)
for k in ("stretch", "full"):
    print("ar / %s: median %.4f" % (k, statistics.median(a / b for a, b in zip(walls["ar"], walls[k]))))
print("stretch / full: median %.4f" % statistics.median(a / b for a, b in zip(walls["full"], walls["stretch"])))
