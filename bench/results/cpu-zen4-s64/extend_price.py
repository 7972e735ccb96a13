import torch, time
from heterospec import Engine
from heterospec.models.linear import settled_weights
torch.set_num_threads(2)
eng = Engine.from_pretrained()
cm = eng.cost_model
d = eng.draft
for B, n in ((1, 150), (4, 150), (1, 32), (4, 32), (1, 16)):
    cache = d.new_cache(B, 1024)
    toks = torch.randint(0, 1000, (B, n)); feats = torch.randn(B, n, d.fc.in_features if hasattr(d, 'fc') else 1728)
    ts = []
    with torch.inference_mode(), settled_weights():
        for r in range(5):
            t = time.perf_counter(); d.extend(toks, feats, cache, torch.zeros(B, dtype=torch.long), torch.full((B,), n)); ts.append(time.perf_counter() - t)
    print(B, n, "extend %.2f ms" % (1e3 * min(ts)), "model draft_ms(B,0,n) %.2f" % cm.draft_ms(B, 0, n), "model excess over 2 tokens %.2f" % (cm.draft_ms(B, 0, n) - cm.draft_ms(B, 0, 2)))
