"""Batch 1 through generate_batch (the batch sweep's first prompt, 96 tokens): heterospec against
autoregressive, alternated, 5 repeats; per-call times of the engine's steps, and a cProfile of one
heterospec call (top entries by own time)."""
import cProfile, collections, functools, pstats, time, torch
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
eng = Engine.from_pretrained()
sets = load_prompt_sets(["mtbench", "alpaca"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
acc, cnt, cur = collections.Counter(), collections.Counter(), [None]
def wrap(name):
    f = getattr(eng, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[(cur[0], name)] += time.perf_counter() - t; cnt[(cur[0], name)] += 1; return r
    setattr(eng, name, g)
names = [n for n in ("_plain_step", "_decode_one", "_prefill", "_round", "_draft_tree", "_verify", "_commit") if hasattr(eng, n)]
for n in names: wrap(n)
for m in ("autoregressive", "heterospec"):
    eng.generate_batch(prompts[:1], max_new_tokens=8, **bench_call(m))
tot, toks = collections.Counter(), collections.Counter()
for rep in range(5):
    for m in (("autoregressive", "heterospec") if rep % 2 == 0 else ("heterospec", "autoregressive")):
        cur[0] = m
        t = time.perf_counter(); r = eng.generate_batch(prompts[:1], max_new_tokens=96, **bench_call(m)); dt = time.perf_counter() - t
        tot[m] += dt; toks[m] += 96
        print(rep, m, "%.1f tok/s" % (96 / dt))
for m in ("autoregressive", "heterospec"):
    print(m, "%.1f tok/s" % (toks[m] / tot[m]), "  ".join("%s %.3f ms x%d" % (n, acc[(m, n)] / cnt[(m, n)] * 1e3, cnt[(m, n)]) for n in names if cnt[(m, n)]))
print("ratio %.3f" % ((toks["heterospec"] / tot["heterospec"]) / (toks["autoregressive"] / tot["autoregressive"])))
pr = cProfile.Profile(); pr.enable(); eng.generate_batch(prompts[:1], max_new_tokens=96, **bench_call("heterospec")); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
