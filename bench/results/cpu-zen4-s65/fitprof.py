import torch, time, cProfile, pstats, io
from heterospec import Engine
from heterospec.bench import bench_call
from heterospec.policy import fit_plan
eng = Engine.from_pretrained(dtype="bfloat16")
eng.generate("Write a poem about the sea.", max_new_tokens=32, **bench_call("heterospec"))
pol = next(iter(eng._fitted.values()))
b, c = 1, 256
s, t, q = pol.position_scale(), pol.time_scale(b), pol.plain_scale(b)
f, g = pol.bin_frequencies(), pol.bin_scale()
def one(options=None):
    return fit_plan(pol.tables, pol._memo, b, c, pol.ragged, max_nodes=pol.max_nodes, position_scale=s, time_scale=t,
                    plain_scale=q, bin_freq=f, shortlist=pol._shortlist, bin_scale=g, static=pol.static, options=options, scores={}, fits={})
for opts in (None, [0, 1, 2]):
    one(opts)
    t0 = time.perf_counter(); n = 20
    for _ in range(n): one(opts)
    print(opts, "%.2f ms per fit" % (1e3 * (time.perf_counter() - t0) / n))
pr = cProfile.Profile(); pr.enable()
for _ in range(20): one([0, 1, 2])
pr.disable(); o = io.StringIO(); pstats.Stats(pr, stream=o).sort_stats("tottime").print_stats(18); print(o.getvalue()[-5000:])
