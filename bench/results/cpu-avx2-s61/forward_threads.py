import torch, time, sys
from heterospec import Engine
eng = Engine.from_pretrained()
tgt = eng.target
cache = tgt.new_cache(1, 1024)
ctx = 256
with torch.inference_mode():
    ids = torch.randint(0, 1000, (1, ctx))
    tgt.forward(ids, torch.arange(ctx)[None], cache, torch.zeros(1, dtype=torch.long))
    for rows in (1, 4):
        ids = torch.randint(0, 1000, (1, rows)); pos = torch.arange(ctx, ctx + rows)[None]
        best = {}
        for r in range(30):
            for th in (1, 2):
                torch.set_num_threads(th)
                t = time.perf_counter(); tgt.forward(ids, pos, cache, torch.tensor([ctx]), return_features=False)
                best[th] = min(best.get(th, 1e9), time.perf_counter() - t)
        print(rows, {k: round(v * 1e3, 2) for k, v in best.items()})
