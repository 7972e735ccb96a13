# A/B: the layer glue as ops (CPU_GLUE_OPS) vs the PyTorch formulas, target forward, alternating
import time, torch, statistics, sys
from heterospec import Engine
import heterospec.models.layers as L
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
ids = eng._encode("Write a short poem about the sea and the sky, in the style of an old sailor.", True)
def fwd(T, reps=20):
    cache = tgt.new_cache(1, 512)
    P = len(ids)
    with torch.inference_mode():
        tgt(torch.tensor([ids]), torch.arange(P)[None], cache, torch.tensor([0]))
        x = torch.tensor([ids[:T]]); pos = torch.arange(P, P + T)[None]; pl = torch.tensor([P])
        mask = torch.ones(1, T, T, dtype=torch.bool).tril()
        ts = []
        for _ in range(reps):
            t = time.perf_counter(); tgt(x, pos, cache, pl, tree_mask=mask); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1000
res = {}
for rep in range(5):
    for on in (False, True):
        L.CPU_GLUE_OPS = on
        for T in (1, 8):
            res.setdefault((on, T), []).append(fwd(T))
for T in (1, 8):
    a, b = statistics.median(res[(False, T)]), statistics.median(res[(True, T)])
    print(f"T={T}: formulas {a:.2f} ms, ops {b:.2f} ms, ratio {b/a:.3f}")
