"""stream_linear_blocks with and without the widened kernels, interleaved per call in one process (best of
REPS alternating passes per shape and row count; 30 weight copies per layer shape, 2 for lm_head). Needs a
build with the temporary per-call switch HS_EXP_NO_WIDEN (set: the kernels before; not in the product).
Usage: python blocks_inproc.py REPS [ROWS,ROWS,...]"""
import os, sys, time, json, torch, heterospec
from heterospec.models.linear import _random_codes
SHAPES = [("qkv", 960, 576, "q4_1", 30), ("o", 576, 576, "q4_1", 30), ("gate_up", 3072, 576, "q4_1", 30),
          ("down", 576, 1536, "q4_1", 30), ("lm_head", 49152, 576, "q8_0", 2)]
rows = [int(r) for r in sys.argv[2].split(",")] if len(sys.argv) > 2 else [3, 4, 6, 8, 12, 16]
arms = {"old": "1", "new": None}
op = torch.ops.heterospec.stream_linear_blocks.default
res = {}
torch.manual_seed(0)
for name, N, K, fmt, copies in SHAPES:
    ws = [_random_codes(N, K, fmt) for _ in range(copies)]
    for M in rows:
        x = torch.randn(M, K)
        best = {a: float("inf") for a in arms}
        for r in range(int(sys.argv[1])):
            for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                if arms[a]: os.environ["HS_EXP_NO_WIDEN"] = "1"
                else: os.environ.pop("HS_EXP_NO_WIDEN", None)
                for c, s in ws: op(x, c, s, None, N)
                t0 = time.perf_counter()
                for c, s in ws: op(x, c, s, None, N)
                best[a] = min(best[a], (time.perf_counter() - t0) / copies)
        res[f"{name}/{M}"] = best
        print(f"{name:8s} M={M:2d} old {1e3*best['old']:7.3f} new {1e3*best['new']:7.3f} new/old {best['new']/best['old']:.3f}", flush=True)
