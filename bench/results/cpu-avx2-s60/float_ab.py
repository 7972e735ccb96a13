"""Run against this session's temporary build with the HS_HALVES switch (the AVX2 half-block kernels for every row count); the switch is not in the shipped code."""
import torch, time, os
from heterospec import ops
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
N, K = 3072, 576
res = {}
for name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16), ("f16vals", "f16")):
    w = torch.randn(N, K, generator=g)
    if dt == "f16": w = w.half().float(); packs = [ops.stream_linear_pack(w) for _ in range(20)]
    else: packs = [ops.stream_linear_pack(w.to(dt)) for _ in range(20)]
    for M in (1, 2, 3):
        x = torch.randn(M, K).to(torch.bfloat16 if dt == torch.bfloat16 else torch.float32)
        outs = {}
        for r in range(8):
            for arm in ("halves", "one"):
                if arm == "halves": os.environ["HS_HALVES"] = "1"
                else: os.environ.pop("HS_HALVES", None)
                t = time.perf_counter()
                for p in packs: o = ops.stream_linear(x, p, None, N)
                dt_ = time.perf_counter() - t
                res[(name, M, arm)] = min(res.get((name, M, arm), 1e9), dt_)
                outs[arm] = o
        print(name, M, "halves %.3f one %.3f ms/call  %.3fx  equal %s" % (res[(name, M, "halves")] / 20 * 1e3, res[(name, M, "one")] / 20 * 1e3, res[(name, M, "one")] / res[(name, M, "halves")], torch.equal(outs["halves"], outs["one"])))
