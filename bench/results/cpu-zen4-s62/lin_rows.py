"""The target's 30 layers' linears (streamed as their GGUF codes) at 1-8 rows, cold per call chain,
best of 15, with the memory roofline of this box (torch's float32 sum of 256 MB).
Run once as is and once with MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 (our kernels then
take their AVX2 paths) to compare the two instruction sets on one machine."""
import os, time, torch
from heterospec import Engine
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
big = torch.randn(64 * 1024 * 1024)
bw = min((lambda t: (big.sum(), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(10))
print("isa cap:", os.environ.get("MKL_ENABLE_INSTRUCTIONS", "machine"), "| float32 sum %.1f GB/s" % (big.numel() * 4 / bw / 1e9))
calls = {}
for rows in (1, 2, 3, 4, 8):
    cl = [c for sl in tgt._build_stream_plans(rows, torch.float32) for c in sl.qkv + [sl.o_proj] + sl.gate_up + [sl.down]]
    xs = {c.args[0].shape[1]: torch.randn(rows, c.args[0].shape[1]) for c in cl}
    calls[rows] = (cl, xs)
nbytes = sum(c.args[0].numel() + c.args[1].numel() * 4 for c in calls[1][0])
best = {}
with torch.inference_mode():
    for r in range(15):
        for rows, (cl, xs) in calls.items():
            t = time.perf_counter()
            for c in cl: c.op(xs[c.args[0].shape[1]], *c.args)
            best[rows] = min(best.get(rows, 1e9), time.perf_counter() - t)
for rows, b in best.items():
    print("rows %d: %.2f ms (%.1f GB/s of weights)" % (rows, b * 1e3, nbytes / b / 1e9))
