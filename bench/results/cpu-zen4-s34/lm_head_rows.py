# The built-in target's lm_head (49,152 x 576, Q8_0 codes) at 1-16 rows: stream_linear_blocks vs oneDNN vs F.linear, cache flushed (thirty-fourth session).
import time, torch, heterospec
from heterospec.engine import Engine
from heterospec.models import linear as L
torch.set_num_threads(2)
eng = Engine.from_pretrained()
lm = eng.target.lm_head
fmt, packed = L.block_codes(lm)
print(type(lm).__name__, fmt, lm.weight.shape)
W = lm.weight.detach()
mk = L._reorder(W)
big = torch.randn(64, 1024, 1024)  # cache flusher 256MB
def t(f, R=20):
    f()
    s = 0
    for _ in range(R):
        big.mul_(1.0)
        t0 = time.perf_counter(); f(); s += time.perf_counter() - t0
    return s / R * 1e3
for m in (1, 2, 4, 6, 8, 9, 10, 12, 16):
    x = torch.randn(m, 576)
    a = t(lambda: L._stream_forward(x, packed, None, W.shape[0]))
    b = t(lambda: L._packed_forward(x, mk, None))
    c = t(lambda: torch.nn.functional.linear(x, W))
    print(f"rows {m:2d}: stream-codes {a:6.2f} ms  mkldnn {b:6.2f}  F.linear {c:6.2f}")
