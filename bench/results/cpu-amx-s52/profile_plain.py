"""cProfile of a batch-B call that heterospec decodes plainly, against autoregressive (52nd session):
    python bench/results/cpu-amx-s52/profile_plain.py float32 8
"""
import sys, time, cProfile, pstats
from heterospec.bench import bench_call
from _setup import benchmark_prompts, engine
dtype, B = sys.argv[1], int(sys.argv[2])
eng = engine(dtype)
prompts = benchmark_prompts()
ps = prompts[:B]
for m in ("autoregressive", "heterospec"):
    eng.generate_batch(ps, max_new_tokens=96, **bench_call(m))
stats = {}
for m in ("autoregressive", "heterospec"):
    pr = cProfile.Profile(); t = time.perf_counter(); pr.enable()
    res = eng.generate_batch(ps, max_new_tokens=96, **bench_call(m))
    pr.disable(); w = time.perf_counter() - t
    rec = [r for x in res for r in x.stats.records]
    print("=====", m, "wall %.3f" % w, "plain", sum(r.plain for r in rec), "spec/lookup", sum(not r.plain for r in rec))
    stats[m] = pstats.Stats(pr).stats
a, h = stats["autoregressive"], stats["heterospec"]
keys = set(a) | set(h)
def tt(d, k): return d[k][2] if k in d else 0.0
def ct(d, k): return d[k][3] if k in d else 0.0
print("largest tottime differences (ms): heterospec - autoregressive")
for k in sorted(keys, key=lambda k: -abs(tt(h, k) - tt(a, k)))[:25]:
    print("%8.1f %8.1f  %s:%d(%s)" % (1e3 * (tt(h, k) - tt(a, k)), 1e3 * (ct(h, k) - ct(a, k)), *k))
print("cumulative differences of heterospec's own functions (ms)")
for k in sorted((k for k in keys if "/heterospec/" in k[0]), key=lambda k: -abs(ct(h, k) - ct(a, k)))[:30]:
    print("%8.1f %8.1f %6d  %s:%d(%s)" % (1e3 * (ct(h, k) - ct(a, k)), 1e3 * ct(h, k), h[k][1] if k in h else 0, *k))
