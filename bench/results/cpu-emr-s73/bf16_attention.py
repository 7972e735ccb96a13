"""tree_attention of one layer (9 query heads, 3 KV heads, D 64, one new token) at batch B and L cached tokens:
the op on a bfloat16 cache (its K/V widened to float32 copies inside the op), the same with the casts done by
ATen before a float32 call, and the float32 op alone; interleaved 3x, the least median of 80 calls."""
import time, statistics, torch, heterospec
torch.set_num_threads(2)
for B, L in ((1, 300), (1, 1000), (8, 300), (8, 100)):
    k = torch.randn(B, L + 64, 3, 64, dtype=torch.bfloat16)
    q = torch.randn(B, 1, 9, 64, dtype=torch.bfloat16); v = torch.randn_like(k)
    lens = torch.full((B,), L); mask = torch.ones(B, 1, 1, dtype=torch.bool)
    def seq():
        a = q.float(); b = k.narrow(1, 0, L + 1).float(); c = v.narrow(1, 0, L + 1).float()
        return torch.ops.heterospec.tree_attention(a, b, c, lens, mask, 0.125).bfloat16()
    def f32():
        return torch.ops.heterospec.tree_attention(qf, kf, vf, lens, mask, 0.125)
    qf, kf, vf = q.float(), k.float(), v.float()
    res = {}
    for rep in range(3):
        for name, fn in (("op bf16", lambda: torch.ops.heterospec.tree_attention(q, k, v, lens, mask, 0.125)), ("ATen casts + op f32", seq), ("op f32", f32)):
            ts=[]
            for i in range(100):
                t0=time.perf_counter(); fn(); ts.append(time.perf_counter()-t0)
            res.setdefault(name, []).append(statistics.median(ts[20:]))
    print(B, L, {k: f"{1e6*min(v):.1f} us" for k, v in res.items()})
