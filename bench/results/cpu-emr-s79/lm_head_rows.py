"""The built-in target's lm_head (tied, 49,152 x 576) timed at 1-16 rows, warm (median of 60)."""
import time, torch, heterospec
torch.manual_seed(0)
eng = heterospec.Engine.from_pretrained()
tgt = eng.target
print(type(tgt.lm_head), tgt.lm_head.weight.shape, tgt.lm_head.weight.dtype, eng.draft_dtype_report if hasattr(eng,'draft_dtype_report') else '')
H = tgt.config.hidden_size
def bench(f, n=60):
    for _ in range(5): f()
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort(); return ts[len(ts)//2]*1e3
with torch.no_grad():
    for M in (1,2,3,4,5,6,8,9,12,16):
        x = torch.randn(1, M, H)
        print(M, "lm_head ms %.3f" % bench(lambda: tgt.lm_head(tgt.norm(x))))
