"""Python garbage collections during a batch-B call, autoregressive vs heterospec (52nd session):
count and time per generation (gc.callbacks), and the objects tracked:
    python bench/results/cpu-amx-s52/gc_per_call.py float32 4
"""
import sys, time, gc, collections
from heterospec.bench import bench_call
from _setup import benchmark_prompts, engine
dtype, B = sys.argv[1], int(sys.argv[2])
eng = engine(dtype)
prompts = benchmark_prompts()
ps = prompts[:B]
acc, t0 = collections.defaultdict(lambda: [0, 0.0]), [0.0]
def cb(phase, info):
    if phase == "start":
        t0[0] = time.perf_counter()
    else:
        a = acc[info["generation"]]; a[0] += 1; a[1] += time.perf_counter() - t0[0]
gc.callbacks.append(cb)
for m in ("autoregressive", "heterospec"):
    eng.generate_batch(ps, max_new_tokens=96, **bench_call(m))
print("objects tracked:", len(gc.get_objects()))
for m in ("autoregressive", "heterospec", "autoregressive", "heterospec"):
    acc.clear()
    t = time.perf_counter(); eng.generate_batch(ps, max_new_tokens=96, **bench_call(m)); w = time.perf_counter() - t
    print(m, "wall %.4f" % w, {g: (n, round(1e3 * s, 1)) for g, (n, s) in sorted(acc.items())})
