"""Mean wall time of Engine._decode_one / _plain_step under autoregressive vs heterospec (plain rounds) at batch B, interleaved."""
import sys, time, torch, heterospec, statistics
from heterospec.datasets import load_prompts
from heterospec import engine as E
torch.set_num_threads(2)
e = heterospec.Engine.from_pretrained(dtype=getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else None)
B = int(sys.argv[1])
texts = [p.text for p in load_prompts("mtbench", n=B)]
acc = {}
cur = [None]
for name in ("_decode_one", "_plain_step"):
    f = getattr(E.Engine, name)
    def w(*a, _f=f, _n=name, **k):
        t = time.perf_counter()
        try: return _f(*a, **k)
        finally: acc.setdefault((cur[0], _n), []).append(time.perf_counter() - t)
    setattr(E.Engine, name, w)
walls = {}
for rep in range(7):
    for m in (("autoregressive", "heterospec") if rep % 2 else ("heterospec", "autoregressive")):
        cur[0] = m if rep else None
        t = time.perf_counter()
        rs = e.generate_batch(texts, max_new_tokens=96, method=m)
        if rep: walls.setdefault(m, []).append(time.perf_counter() - t)
for k, v in sorted((k, v) for k, v in acc.items() if k[0]):
    print(k, f"n={len(v)} mean {1e3*statistics.mean(v):.3f} ms median {1e3*statistics.median(v):.3f}")
for m, v in walls.items(): print(m, [round(x, 3) for x in v])
