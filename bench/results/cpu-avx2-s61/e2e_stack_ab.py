"""End-to-end tok/s with the target's layers as one decoder_layers_ call (STACK_OP) against one
decoder_layer_ call per layer, in one process, arms alternated per prompt; the same tokens in
both arms (asserted). Methods: autoregressive, eagle3, heterospec."""
import sys
import torch
import heterospec.models.target as T
from heterospec import Engine
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
eng = Engine.from_pretrained()
sets = sys.argv[1:] or ["mtbench", "humaneval", "gsm"]
prompts = [p.text for s in sets for p in load_prompts(s, n=2)]
arms = ("per layer", "stack")
methods = ("autoregressive", "eagle3", "heterospec")
eng.generate(prompts[0], max_new_tokens=8)
tot = {(a, m): [0.0, 0] for a in arms for m in methods}
ref = {}
for i, p in enumerate(prompts):
    for a in (arms if i % 2 == 0 else arms[::-1]):
        T.STACK_OP = a == "stack"
        for m in methods:
            r = eng.generate(p, max_new_tokens=128, method=m)
            tot[(a, m)][0] += r.stats.total_s; tot[(a, m)][1] += r.stats.new_tokens
            if (i, m) in ref: assert ref[(i, m)] == r.token_ids, ("output differs", a, m, i)
            ref[(i, m)] = r.token_ids
for m in methods:
    h = tot[("per layer", m)][1] / tot[("per layer", m)][0]; o = tot[("stack", m)][1] / tot[("stack", m)][0]
    print("%-15s per layer %.1f tok/s  stack %.1f tok/s  %.3fx" % (m, h, o, o / h))
print("same tokens in both arms: yes")
