import json, sys, time, torch, heterospec
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
sets = sys.argv[1].split(","); lo, hi = int(sys.argv[2]), int(sys.argv[3])
import os
d = os.environ.get("DRAFT")
e = heterospec.Engine.from_pretrained(os.path.expanduser("~/.cache/heterospec/smollm2-135m-instruct"), d) if d else heterospec.Engine.from_pretrained()
print("prior", e._lookup_prior is not None, file=__import__("sys").stderr)
for m in ("autoregressive", "heterospec"):
    e.generate("Hello there, how are you?", max_new_tokens=8, method=m)
tot = {"autoregressive": 0.0, "heterospec": 0.0}; rows = []
for s in sets:
    ps = load_prompts(s, n=hi)[lo:hi]
    for i, p in enumerate(ps):
        row = {"set": s}
        for m in (("autoregressive", "heterospec") if i % 2 == 0 else ("heterospec", "autoregressive")):
            r = e.generate(p.text, max_new_tokens=128, method=m)
            row[m] = r.stats.total_s; row[m + "_tok"] = len(r.tokens) if hasattr(r, "tokens") else None
            tot[m] += r.stats.total_s
        rows.append(row)
print(json.dumps({"ratio": tot["autoregressive"] / tot["heterospec"], "rows": rows}))
