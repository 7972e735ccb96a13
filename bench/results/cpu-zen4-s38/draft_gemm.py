import time, torch
from vllm import _custom_ops as ops
import heterospec.ops  # noqa: loads torch.ops.heterospec
from heterospec.models.linear import _stream_pack
torch.manual_seed(0)
shapes = {"fc 576x1728": (576, 1728), "qkv 960x576": (960, 576), "o 576x576": (576, 576),
          "gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536), "lm_head 8192x576": (8192, 576)}
def bench(fn, reps=300):
    for _ in range(20): fn()
    t = time.perf_counter()
    for _ in range(reps): fn()
    return 1e3 * (time.perf_counter() - t) / reps
for name, (N, K) in shapes.items():
    copies = 16   # cold-ish: cycle through copies
    ws = [torch.randn(N, K).half().float() for _ in range(copies)]
    hs = [ops.create_onednn_mm(w.t(), 32) for w in ws]
    ps = [_stream_pack(w.half()) for w in ws]
    for M in (1, 2, 3, 8):
        x = torch.randn(M, K)
        i = [0]
        def one():
            i[0] = (i[0] + 1) % copies; return ops.onednn_mm(hs[i[0]], x, None)
        def two():
            i[0] = (i[0] + 1) % copies; return torch.ops.heterospec.stream_linear.default(x, ps[i[0]], None, N)
        a, b = bench(one), bench(two)
        d = (ops.onednn_mm(hs[0], x, None) - torch.ops.heterospec.stream_linear.default(x, ps[0], None, N)).abs().max().item()
        print(f"{name:18s} M={M}: onednn_mm {a*1e3:7.1f} us  stream f16 {b*1e3:7.1f} us  ratio {b/a:.2f}  maxdiff {d:.1e}", flush=True)
