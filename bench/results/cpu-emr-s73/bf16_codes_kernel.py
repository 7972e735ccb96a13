"""One linear of the built-in target's MLP shape (576 -> 1536, Q4_1 values): stream_linear_blocks with a float32 x,
with a bfloat16 x (codes rounded to bfloat16 in registers), and stream_linear on the 16-bit bfloat16 weight;
40 weight copies visited in turn (~18 MB of codes, ~71 MB of bfloat16 weights: both in this box's 260 MiB L3), best of 7, microseconds a call."""
import time, torch, heterospec.ops as ops, sys
sys.path.insert(0, "tests")
from reference import quantize_q4_1_ref
torch.set_num_threads(2)
N, K = 1536, 576
ws = [quantize_q4_1_ref(torch.randn(N, K) * 0.05)[0] for _ in range(40)]   # 40 copies: beyond L2, codes ~18 MB
cs = [ops.stream_linear_pack_blocks(w)[1:] for w in ws]
wb = [ops.stream_linear_pack(w.bfloat16()) for w in ws]
for M in (1, 2, 4, 8):
    x = torch.randn(M, K)
    res = {}
    for name, fn in (("f32 codes", lambda c: ops.stream_linear_blocks(x, c[0], c[1], None, N)),
                     ("bf16 codes", lambda c: ops.stream_linear_blocks(xb, c[0], c[1], None, N)),
                     ("bf16 16-bit", None)):
        xb = x.bfloat16()
        best = 1e9
        for r in range(7):
            t = time.perf_counter()
            if fn is None:
                for p in wb: ops.stream_linear(xb, p, None, N)
            else:
                for c in cs: fn(c)
            best = min(best, (time.perf_counter() - t) / len(cs))
        res[name] = best * 1e6
    print(M, {k: round(v, 1) for k, v in res.items()}, "us per call")
