"""End-to-end tok/s with the AVX2 stream kernels' half-block passes (HS_HALVES set, a temporary
switch of this session's build) against the one-pass kernels for 1-2 rows, in one process,
arms alternated per prompt; the same tokens in both arms."""
import os, sys, time
import torch
from heterospec import Engine
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
eng = Engine.from_pretrained()
sets = sys.argv[1:] or ["mtbench", "humaneval", "gsm"]
prompts = [p.text for s in sets for p in load_prompts(s, n=2)]
arms = ("halves", "one pass")
methods = ("autoregressive", "heterospec")
eng.generate(prompts[0], max_new_tokens=8)
tot = {(a, m): [0.0, 0] for a in arms for m in methods}
ref = {}
for i, p in enumerate(prompts):
    for a in (arms if i % 2 == 0 else arms[::-1]):
        if a == "halves": os.environ["HS_HALVES"] = "1"
        else: os.environ.pop("HS_HALVES", None)
        for m in methods:
            r = eng.generate(p, max_new_tokens=128, method=m)
            tot[(a, m)][0] += r.stats.total_s; tot[(a, m)][1] += r.stats.new_tokens
            if (i, m) in ref: assert ref[(i, m)] == r.token_ids, ("output differs", a, m, i)
            ref[(i, m)] = r.token_ids
for m in methods:
    h = tot[("halves", m)][1] / tot[("halves", m)][0]; o = tot[("one pass", m)][1] / tot[("one pass", m)][0]
    print("%-15s halves %.1f tok/s  one pass %.1f tok/s  %.3fx" % (m, h, o, o / h))
print("same tokens in both arms: yes")
