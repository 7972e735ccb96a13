import torch, time, sys
from heterospec import ops
from heterospec.models.layers import sdpa
def bench(f, n=400):
    for _ in range(30): f()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n): f()
        ts.append((time.perf_counter() - t) / n * 1e6)
    return min(ts)
for th in (1, 2):
    torch.set_num_threads(th)
    for T, L in ((1, 300), (8, 300), (8, 32), (1, 1000)):
        Hq, Hkv, D, S = 9, 3, 64, 1200
        q = torch.randn(1, T, Hq, D); kc = torch.randn(1, S, Hkv, D); vc = torch.randn(1, S, Hkv, D)
        pl = torch.tensor([L]); tm = torch.ones(1, T, T, dtype=torch.bool).tril(); W = L + T
        mask = ops.dense_tree_attention_mask(tm, pl, W)
        a = bench(lambda: sdpa(q, kc[:, :W], vc[:, :W], None if T == 1 else mask, 0.125))
        c = bench(lambda: torch.ops.heterospec.tree_attention.default(q, kc, vc, pl, tm, 0.125))
        pairs = T * Hq * (L + T)
        print(f"threads {th} T={T} L={L}: sdpa(premask) {a:6.1f} us  raw op {c:6.1f} us  = {1e3*c/pairs:5.2f} ns/pair")
