"""tree_attention of one layer of the built-in target (9 query heads, 3 KV heads, D 64) at batch B, T query rows
(1: a decode step, 8: a verify) and L cached tokens: the op on a bfloat16 cache (K/V widened inside the kernel's
phases since the seventy-fourth session), the same with the casts done by ATen before a float32 call (what the op
did before), and the float32 op alone. Interleaved 3x, the least median of 80 calls."""
import statistics, time

import torch

import heterospec  # noqa: F401  (loads the ops)

torch.set_num_threads(2)
op = torch.ops.heterospec.tree_attention
for B, T, L in ((1, 1, 300), (1, 1, 1000), (1, 8, 300), (8, 1, 300), (8, 8, 300)):
    k = torch.randn(B, L + 64, 3, 64, dtype=torch.bfloat16)
    q = torch.randn(B, T, 9, 64, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((B,), L)
    mask = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T).contiguous()
    qf, kf, vf = q.float(), k.float(), v.float()

    def aten_casts():
        a, b, c = q.float(), k.narrow(1, 0, L + T).float(), v.narrow(1, 0, L + T).float()
        return op(a, b, c, lens, mask, 0.125).bfloat16()

    arms = (("op bf16", lambda: op(q, k, v, lens, mask, 0.125)), ("ATen casts + op f32", aten_casts),
            ("op f32", lambda: op(qf, kf, vf, lens, mask, 0.125)))
    assert torch.equal(arms[0][1](), aten_casts())
    res = {}
    for rep in range(3):
        for name, fn in arms:
            ts = []
            for i in range(100):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            res.setdefault(name, []).append(statistics.median(ts[20:]))
    print(f"B={B} T={T} L={L}", {k: f"{1e6 * min(v):.1f} us" for k, v in res.items()}, flush=True)
