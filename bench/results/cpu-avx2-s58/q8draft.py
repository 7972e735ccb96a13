import torch, time, sys
from heterospec import Engine
from heterospec.datasets import load_prompts
from heterospec.models import linear as L
torch.set_num_threads(2)

def q8_(w):
    N, K = w.shape
    g = w.reshape(N, K // 32, 32)
    d = (g.abs().amax(-1) / 127.0).half().float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = (g / safe[..., None]).round().clamp(-127, 127)
    return (q * d[..., None]).reshape(N, K)

e1 = Engine.from_pretrained()
e2 = Engine.from_pretrained()
with torch.no_grad():
    for name, mod in e2.draft.named_modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.shape[1] % 32 == 0:
            mod.weight.copy_(q8_(mod.weight))
L.untune_linears([e2.target, e2.draft]); L.tune_linears([e2.target, e2.draft])
print("codes:", L.coded_formats([e2.draft]))
prompts = [p.text for s in ("mtbench", "alpaca", "humaneval") for p in load_prompts(s, n=3)]
for e in (e1, e2): e.generate(prompts[0], max_new_tokens=16, method="eagle3")
acc = {1: [0, 0, 0, 0], 2: [0, 0, 0, 0]}
for rep, p in enumerate(prompts):
    for tag, e in ((1, e1), (2, e2)) if rep % 2 == 0 else ((2, e2), (1, e1)):
        r = e.generate(p, max_new_tokens=96, method="eagle3")
        s = r.stats
        a = acc[tag]; a[0] += s.draft_s; a[1] += s.rounds; a[2] += s.total_s; a[3] += s.new_tokens
        print(tag, "tau %.2f draft/round %.2f ms tok/s %.1f" % (s.tau, 1e3 * s.draft_s / s.rounds, s.tokens_per_s), flush=True)
for tag in (1, 2):
    a = acc[tag]; print(tag, "draft/round %.2f ms, tau %.3f, tok/s %.1f" % (1e3 * a[0] / a[1], a[3] / a[1], a[3] / a[2]))
