"""stream_linear_blocks per row count on the built-in target's shapes (one process = one ISA).

    python blocks_rows.py OUT.json [--rows 1 2 4 6 8 12 16] [--reps 5]

Each shape is timed over COPIES weight copies visited in turn (as a model streams 30 layers),
best of --reps passes; GFLOP/s = 2 N K M / t. Run it twice, once under
MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 (our kernels' AVX2 paths), to compare.
"""
import argparse, json, os, sys, time
import torch
import heterospec  # noqa: F401  (loads the ops)
from heterospec.models.linear import _random_codes

SHAPES = [("qkv", 960, 576, "q4_1", 30), ("o", 576, 576, "q4_1", 30), ("gate_up", 3072, 576, "q4_1", 30),
          ("down", 576, 1536, "q4_1", 30), ("lm_head", 49152, 576, "q8_0", 2)]

def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16])
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    op = torch.ops.heterospec.stream_linear_blocks.default
    res = {"isa_env": os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""), "threads": torch.get_num_threads(), "ms": {}}
    torch.manual_seed(0)
    for name, N, K, fmt, copies in SHAPES:
        ws = [_random_codes(N, K, fmt) for _ in range(copies)]
        for M in a.rows:
            x = torch.randn(M, K)
            for c, s in ws:
                op(x, c, s, None, N)
            best = float("inf")
            for _ in range(a.reps):
                t0 = time.perf_counter()
                for c, s in ws:
                    op(x, c, s, None, N)
                best = min(best, (time.perf_counter() - t0) / copies)
            res["ms"][f"{name}/{M}"] = 1e3 * best
            print(f"{name:8s} M={M:2d} {1e3*best:8.3f} ms  {2*N*K*M/best/1e9:7.1f} GFLOP/s", flush=True)
    json.dump(res, open(a.out, "w"), indent=1)

main()
