"""Per call (all requests' rounds) of a batch-B sweep-like sequence: heterospec's rounds by kind and wall vs autoregressive (52nd session):
    python bench/results/cpu-amx-s52/rounds_by_call.py float32 2 6
"""
import sys, time
from heterospec.bench import bench_call
from _setup import benchmark_prompts, engine
dtype, B, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = engine(dtype)
prompts = benchmark_prompts()
for i in range(calls):
    ps = [prompts[(i * B + j) % len(prompts)] for j in range(B)]
    row = []
    for m in ("autoregressive", "heterospec"):
        t = time.perf_counter(); res = eng.generate_batch(ps, max_new_tokens=96, **bench_call(m)); w = time.perf_counter() - t
        recs = [r for x in res for r in x.stats.records]
        kinds = {"plain": sum(r.plain for r in recs), "lookup": sum(r.lookup for r in recs),
                 "spec": sum(not r.plain and not r.lookup for r in recs)}
        row.append((m, round(w, 3), kinds))
    print(i, row, "ratio %.3f" % (row[0][1] / row[1][1]), flush=True)
