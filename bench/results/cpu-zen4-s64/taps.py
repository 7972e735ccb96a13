import torch, time
from heterospec import Engine
from heterospec.models.linear import settled_weights
torch.set_num_threads(2)
eng = Engine.from_pretrained(dtype="bfloat16")
t = eng.target; B = 16
cache = t.new_cache(B, 1024)
x = torch.randint(0, 1000, (B, 300))
with torch.inference_mode(), settled_weights():
    lens = torch.full((B,), 300)
    t(x, torch.arange(300).expand(B, 300), cache, torch.zeros(B, dtype=torch.long), None, lens, logits_index=(lens-1)[:, None])
    root = torch.randint(0, 1000, (B,))
    res = {True: [], False: []}
    for i in range(200):
        f = bool(i % 2)
        pl = lens.clone()
        t0 = time.perf_counter()
        t(root[:, None], pl[:, None], cache, pl, None, None, return_features=f, taps=eng._taps if f else None)
        res[f].append(time.perf_counter() - t0)
import statistics as s
for f in (False, True): print(f, "median %.3f ms mean %.3f" % (1e3 * s.median(res[f]), 1e3 * s.mean(res[f])))
