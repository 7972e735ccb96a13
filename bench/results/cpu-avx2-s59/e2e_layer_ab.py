"""End-to-end tok/s with the layer's glue call by call vs rope_kv_write_ + decoder_layer_, in one process."""
import torch, time
from heterospec import Engine
import heterospec.models.target as TM
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
eng = Engine.from_pretrained()
prompts = [p.text for s in ("mtbench", "humaneval", "gsm") for p in load_prompts(s, n=2)]
arms = {"calls": (False, False), "ops": (True, True)}
methods = ("autoregressive", "heterospec")
eng.generate(prompts[0], max_new_tokens=8)
tot = {(a, m): [0.0, 0] for a in arms for m in methods}
ref = {}
for i, p in enumerate(prompts):
    for a in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
        TM.ROPE_KV_WRITE, TM.LAYER_OP = arms[a]
        for m in methods:
            r = eng.generate(p, max_new_tokens=128, method=m)
            tot[(a, m)][0] += r.stats.total_s; tot[(a, m)][1] += r.stats.new_tokens
            key = (i, m)
            if key in ref: assert ref[key] == r.token_ids, ("output differs", a, m, i)
            ref[key] = r.token_ids
for m in methods:
    c = tot[("calls", m)][1] / tot[("calls", m)][0]; o = tot[("ops", m)][1] / tot[("ops", m)][0]
    print("%-15s calls %.1f tok/s  ops %.1f tok/s  %.3fx" % (m, c, o, o / c))
print("same tokens in both arms: yes")
