import torch, time, sys, json
from heterospec import Engine, SpecConfig
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
eng = Engine.from_pretrained()
sets = sys.argv[1].split(",")
n = int(sys.argv[2]) if len(sys.argv) > 2 else 4
prompts = [p.text for s in sets for p in load_prompts(s, n=n)]
arms = {"ar": dict(method="autoregressive"),
        "chain1": dict(method="eagle3", config=SpecConfig(top_k=1, depth=0, total_tokens=2)),
        "chain2": dict(method="eagle3", config=SpecConfig(top_k=1, depth=1, total_tokens=3)),
        "tree4": dict(method="eagle3", config=SpecConfig(top_k=2, depth=1, total_tokens=4)),
        "hs": dict(method="heterospec")}
eng.generate(prompts[0], max_new_tokens=8)
for a, kw in arms.items():
    eng.generate(prompts[0], max_new_tokens=8, **kw)
tot = {a: [0.0, 0, 0, 0] for a in arms}
ref = {}
for i, p in enumerate(prompts):
    order = list(arms)[i % len(arms):] + list(arms)[:i % len(arms)]
    for a in order:
        r = eng.generate(p, max_new_tokens=128, **arms[a])
        tot[a][0] += r.stats.total_s; tot[a][1] += r.stats.new_tokens; tot[a][2] += r.stats.rounds
        tot[a][3] += sum(x.accept_len for x in r.stats.records) if r.stats.records else 0
        if a == "ar": ref[i] = r.token_ids
        elif i in ref and r.token_ids != ref[i]: print("MISMATCH", a, i)
ar = tot["ar"][1] / tot["ar"][0]
for a, (s, t, rd, acc) in tot.items():
    print("%-7s %.1f tok/s %.3fx AR  rounds %d  tokens/round %.2f" % (a, t / s, t / s / ar, rd, t / max(rd, 1)))
