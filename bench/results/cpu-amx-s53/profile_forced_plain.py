"""cProfile of a batch-B call heterospec decodes plainly (ForcedPolicy speculate=False, no
lookup) against autoregressive, the largest differences (53rd session):
    python bench/results/cpu-amx-s53/profile_forced_plain.py float32 16
"""
import sys, time, cProfile, pstats
from heterospec.policy import ForcedPolicy
from _setup import benchmark_prompts, engine
dtype, B = sys.argv[1], int(sys.argv[2])
eng = engine(dtype)
ps = benchmark_prompts()[:B]
pol = ForcedPolicy(eng.tables, eng.cost_model, eng.config, speculate=False, ragged=eng.ragged_verify)
arms = {"autoregressive": dict(method="autoregressive"), "plain": dict(method="heterospec", policy=pol, lookup=False)}
for kw in arms.values():
    eng.generate_batch(ps, max_new_tokens=96, **kw)
stats = {}
for m, kw in arms.items():
    pr = cProfile.Profile(); t = time.perf_counter(); pr.enable()
    eng.generate_batch(ps, max_new_tokens=96, **kw)
    pr.disable(); print(m, "wall %.3f" % (time.perf_counter() - t))
    stats[m] = pstats.Stats(pr).stats
a, h = stats["autoregressive"], stats["plain"]
def tt(d, k): return d[k][2] if k in d else 0.0
def ct(d, k): return d[k][3] if k in d else 0.0
print("largest tottime differences (ms): plain - autoregressive (tottime, cumtime, calls)")
for k in sorted(set(a) | set(h), key=lambda k: -abs(tt(h, k) - tt(a, k)))[:30]:
    print("%8.1f %8.1f %6d %6d  %s:%d(%s)" % (1e3 * (tt(h, k) - tt(a, k)), 1e3 * (ct(h, k) - ct(a, k)),
                                         h[k][1] if k in h else 0, a[k][1] if k in a else 0, *k))
print("cumulative differences of heterospec's own functions (ms; cumtime diff, calls plain/ar)")
for k in sorted((k for k in set(a) | set(h) if "/heterospec/" in k[0]), key=lambda k: -abs(ct(h, k) - ct(a, k)))[:40]:
    print("%8.1f %6d %6d  %s:%d(%s)" % (1e3 * (ct(h, k) - ct(a, k)), h[k][1] if k in h else 0, a[k][1] if k in a else 0, *k))
