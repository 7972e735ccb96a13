"""Run against this session's temporary build whose stream_linear_blocks read HS_SMALL_ISA once a
call (2: the AVX2 kernels for 1-2 rows on this AVX-512 CPU); the switch is not in the shipped code.
A target forward at context 256, 1-2 rows, and the 30 layers' linears alone (cold), arms
alternated, best of 60; the same logits asserted."""
import os, time, torch
from heterospec import Engine
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
cache = tgt.new_cache(1, 1024)
arms = {"avx512": None, "avx2": "2"}
def arm(a):
    if arms[a] is None: os.environ.pop("HS_SMALL_ISA", None)
    else: os.environ["HS_SMALL_ISA"] = arms[a]
with torch.inference_mode():
    tgt.forward(torch.randint(0, 1000, (1, 256)), torch.arange(256)[None], cache, torch.zeros(1, dtype=torch.long))
    for rows in (1, 2):
        ids = torch.randint(0, 1000, (1, rows)); pos = torch.arange(256, 256 + rows)[None]; pl = torch.tensor([256])
        cl = [c for sl in tgt._build_stream_plans(rows, torch.float32) for c in sl.qkv + [sl.o_proj] + sl.gate_up + [sl.down]]
        xs = {c.args[0].shape[1]: torch.randn(rows, c.args[0].shape[1]) for c in cl}
        best, lin, outs = {}, {}, {}
        for r in range(60):
            for a in arms:
                arm(a)
                t = time.perf_counter(); o = tgt.forward(ids, pos, cache, pl); dt = time.perf_counter() - t
                best[a] = min(best.get(a, 1e9), dt); outs[a] = o
                t = time.perf_counter()
                for c in cl: c.op(xs[c.args[0].shape[1]], *c.args)
                lin[a] = min(lin.get(a, 1e9), time.perf_counter() - t)
        assert all(torch.equal(x, y) for x, y in zip(outs["avx512"], outs["avx2"]))
        print("rows %d: forward avx512 %.2f ms, avx2 %.2f ms (%.3fx); layer linears %.2f / %.2f ms (%.3fx); same logits"
              % (rows, best["avx512"] * 1e3, best["avx2"] * 1e3, best["avx2"] / best["avx512"],
                 lin["avx512"] * 1e3, lin["avx2"] * 1e3, lin["avx2"] / lin["avx512"]))
