"""Run against this session's temporary build with the HS_HALVES switch (the AVX2 half-block kernels for every row count); the switch is not in the shipped code."""
import torch, time, os
from heterospec import Engine
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
calls = {}
for rows in (1, 2, 3, 4):
    cl = [c for sl in tgt._build_stream_plans(rows, torch.float32) for c in sl.qkv + [sl.o_proj] + sl.gate_up + [sl.down]]
    xs = {c.args[0].shape[1]: torch.randn(rows, c.args[0].shape[1]) for c in cl}
    calls[rows] = (cl, xs)
nbytes = sum(c.args[0].numel() + c.args[1].numel() * 4 for c in calls[1][0])
best = {}
with torch.inference_mode():
    for r in range(12):
        for arm in ("halves", "one pass"):
            if arm == "halves": os.environ["HS_HALVES"] = "1"
            else: os.environ.pop("HS_HALVES", None)
            for rows, (cl, xs) in calls.items():
                t = time.perf_counter()
                for c in cl: c.op(xs[c.args[0].shape[1]], *c.args)
                dt = time.perf_counter() - t
                best[(arm, rows)] = min(best.get((arm, rows), 1e9), dt)
for rows in calls:
    h, o = best[("halves", rows)], best[("one pass", rows)]
    print("rows %d: halves %.2f ms (%.1f GB/s), one pass %.2f ms (%.1f GB/s), %.3fx" % (rows, h * 1e3, nbytes / h / 1e9, o * 1e3, nbytes / o / 1e9, o / h))
