import torch, collections
from heterospec import Engine
import heterospec.models.draft as DM
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
eng = Engine.from_pretrained()
prompts = [p.text for s in ("mtbench", "humaneval", "gsm") for p in load_prompts(s, n=2)]
eng.generate(prompts[0], max_new_tokens=8, method="eagle3")
tot = collections.defaultdict(lambda: [0.0, 0, 0.0, 0])
for rep in range(3):
    for i, p in enumerate(prompts):
        for a in ((False, True) if (i + rep) % 2 == 0 else (True, False)):
            DM.LAYER_OP = a
            r = eng.generate(p, max_new_tokens=128, method="eagle3")
            t = tot[a]; t[0] += r.stats.total_s; t[1] += r.stats.new_tokens
            t[2] += sum(x.draft_s for x in r.stats.records); t[3] += len(r.stats.records)
for a in (False, True):
    t = tot[a]; print("layer op" if a else "call by call", "%.1f tok/s, draft %.3f ms/round" % (t[1] / t[0], 1e3 * t[2] / t[3]))
print("ratio %.3f" % ((tot[True][1] / tot[True][0]) / (tot[False][1] / tot[False][0])))
