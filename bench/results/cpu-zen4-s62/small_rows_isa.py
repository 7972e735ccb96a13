"""A one-token and a two-token target forward (context 256, best of 60) and the 30 layers' linears
at 1-2 rows (cold, best of 30), in this process's small-row kernels (HETEROSPEC_SMALL_ROWS_ISA:
avx512, avx2, or unset: measured at the first call). small_rows_isa.sh runs it alternately."""
import os, time, torch
from heterospec import Engine
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
cache = tgt.new_cache(1, 1024)
out = []
with torch.inference_mode():
    tgt.forward(torch.randint(0, 1000, (1, 256)), torch.arange(256)[None], cache, torch.zeros(1, dtype=torch.long))
    for rows in (1, 2):
        ids = torch.randint(0, 1000, (1, rows)); pos = torch.arange(256, 256 + rows)[None]; pl = torch.tensor([256])
        cl = [c for sl in tgt._build_stream_plans(rows, torch.float32) for c in sl.qkv + [sl.o_proj] + sl.gate_up + [sl.down]]
        xs = {c.args[0].shape[1]: torch.randn(rows, c.args[0].shape[1]) for c in cl}
        fwd = lin = 1e9
        for _ in range(60):
            t = time.perf_counter(); tgt.forward(ids, pos, cache, pl); fwd = min(fwd, time.perf_counter() - t)
            t = time.perf_counter()
            for c in cl: c.op(xs[c.args[0].shape[1]], *c.args)
            lin = min(lin, time.perf_counter() - t)
        out.append("rows %d: forward %.2f ms, linears %.2f ms" % (rows, fwd * 1e3, lin * 1e3))
print("%-8s" % os.environ.get("HETEROSPEC_SMALL_ROWS_ISA", "measured"), " | ".join(out))
