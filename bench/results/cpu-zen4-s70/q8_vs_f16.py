import time, torch, heterospec.ops as ops
from heterospec.models.linear import q8_0_values, _stream_pack
torch.set_num_threads(2)
shapes = {"qkv": (960, 1152), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "fc": (576, 1728), "lm_head": (8192, 576)}
def best(fn, reps=200):
    for _ in range(20): fn()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps): fn()
        ts.append((time.perf_counter() - t) / reps)
    return min(ts) * 1e3
tot = {}
for rows in (1, 2, 8):
    for name, (N, K) in shapes.items():
        w = (torch.randn(N, K) * 0.02).half().float()
        f16 = _stream_pack(w.half())
        w8 = q8_0_values(w)
        fmt, codes, scales = ops.stream_linear_pack_blocks(w8)
        assert fmt == "q8_0"
        x = torch.randn(rows, K)
        a = best(lambda: torch.ops.heterospec.stream_linear.default(x, f16, None, N))
        b = best(lambda: torch.ops.heterospec.stream_linear_blocks.default(x, codes, scales, None, N))
        c = best(lambda: torch.nn.functional.linear(x, w))
        tot.setdefault(rows, [0, 0, 0]); tot[rows][0] += a; tot[rows][1] += b; tot[rows][2] += c
        print(f"rows {rows} {name:8s} f16 {a:.4f} ms  q8_0 {b:.4f} ms  F.linear f32 {c:.4f} ms")
for r, (a, b, c) in tot.items():
    print(f"rows {r}: all six: f16 {a:.3f} ms, q8_0 {b:.3f} ms ({b/a:.2f}x), F.linear {c:.3f}")
