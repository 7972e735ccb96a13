"""Run against this session's temporary build whose stream_linear (float / bfloat16 / float16
weights) read HS_SMALL_ISA once a call (2: the AVX2 one-pass kernels for 1-2 rows on this AVX-512
CPU); the switch is not in the shipped code. A bfloat16 target's forward at context 256, 1-2
rows, arms alternated, best of 40; the same logits asserted."""
import os, time, torch
from heterospec import Engine
torch.set_num_threads(2)
eng = Engine.from_pretrained(dtype=torch.bfloat16)
tgt = eng.target
cache = tgt.new_cache(1, 1024)
with torch.inference_mode():
    tgt.forward(torch.randint(0, 1000, (1, 256)), torch.arange(256)[None], cache, torch.zeros(1, dtype=torch.long))
    for rows in (1, 2):
        ids = torch.randint(0, 1000, (1, rows)); pos = torch.arange(256, 256 + rows)[None]; pl = torch.tensor([256])
        best, outs = {}, {}
        for r in range(40):
            for arm in ("avx512", "avx2"):
                if arm == "avx2": os.environ["HS_SMALL_ISA"] = "2"
                else: os.environ.pop("HS_SMALL_ISA", None)
                t = time.perf_counter(); o = tgt.forward(ids, pos, cache, pl); dt = time.perf_counter() - t
                best[arm] = min(best.get(arm, 1e9), dt); outs[arm] = o
        same = all(torch.equal(a, b) for a, b in zip(outs["avx512"], outs["avx2"]))
        print("bfloat16 target, rows %d: forward avx512 %.2f ms, avx2 %.2f ms (%.3fx), same logits: %s"
              % (rows, best["avx512"] * 1e3, best["avx2"] * 1e3, best["avx2"] / best["avx512"], same))
