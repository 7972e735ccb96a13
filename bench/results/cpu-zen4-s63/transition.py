"""A float32 one-token and two-token forward (context 256) timed right after a 64-token forward
(how the quick cost model's interleaved passes run them) and right after a forward of its own
kind (how steady decoding runs plain steps), alternated, medians and minima of 60."""
import statistics, time
import torch
from heterospec import Engine
from heterospec.models.linear import settled_weights
torch.set_num_threads(2)
torch.set_grad_enabled(False)
eng = Engine.from_pretrained()
t = eng.target
cache = t.new_cache(1, 512)
t(torch.randint(0, 40000, (1, 256)), torch.arange(256)[None], cache, torch.zeros(1, dtype=torch.long))
pl = torch.tensor([256])


def fwd(T):
    ids = torch.randint(0, 40000, (1, T)); pos = (256 + torch.arange(T))[None]
    return lambda: t(ids, pos, cache, pl, None, None, return_features=True)


f1, f2, f64 = fwd(1), fwd(2), fwd(64)
res = {k: [] for k in ("1 after 64", "1 after 1", "2 after 64", "2 after 2")}
with settled_weights():
    for _ in range(60):
        for T, f in ((1, f1), (2, f2)):
            f64(); s = time.perf_counter(); f(); res[f"{T} after 64"].append(time.perf_counter() - s)
            f(); s = time.perf_counter(); f(); res[f"{T} after {T}"].append(time.perf_counter() - s)
for k, v in res.items():
    print(f"{k:12s} median {1e3 * statistics.median(v):.3f} ms  min {1e3 * min(v):.3f} ms")
