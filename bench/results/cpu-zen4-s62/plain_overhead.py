"""Where a heterospec call that decodes plainly spends time beyond autoregressive's: the alpaca
set's first 3 prompts x 96 tokens, both methods alternated x 3 (tok/s ratio), then one call of
each under cProfile (own time per function, the top entries; per plain step)."""
import cProfile, collections, io, pstats, time, torch
from heterospec import Engine
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
eng = Engine.from_pretrained()
prompts = [p.text for p in load_prompts("alpaca", n=3)]
for m in ("autoregressive", "heterospec"):
    eng.generate(prompts[0], max_new_tokens=8, method=m)
tot, toks = collections.Counter(), collections.Counter()
for rep in range(3):
    for i, p in enumerate(prompts):
        for m in (("autoregressive", "heterospec") if (i + rep) % 2 == 0 else ("heterospec", "autoregressive")):
            r = eng.generate(p, max_new_tokens=96, method=m)
            tot[m] += r.stats.total_s; toks[m] += r.stats.new_tokens
print("ratio heterospec / autoregressive: %.3f" % ((toks["heterospec"] / tot["heterospec"]) / (toks["autoregressive"] / tot["autoregressive"])))
for m in ("autoregressive", "heterospec"):
    pr = cProfile.Profile(); pr.enable(); r = eng.generate(prompts[1], max_new_tokens=96, method=m); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print("=====", m, r.stats.new_tokens, "tokens")
    print("\n".join(s.getvalue().splitlines()[6:30]))
