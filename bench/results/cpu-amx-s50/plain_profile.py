"""Where heterospec's time goes where its policy decodes plainly (fiftieth session): the first B MT-bench
prompts x 96 tokens through generate_batch, autoregressive and heterospec, after a warm-up call each.

--passes N: first N interleaved timing passes (wall-time medians and per-pass ratios);
then a cProfile of --calls calls of each method, printed by cumulative time for heterospec's modules
matching --modules. The RESULTS figures came from:
    python bench/results/cpu-amx-s50/plain_profile.py --batch 2 --passes 6 --calls 0
    python bench/results/cpu-amx-s50/plain_profile.py --batch 2 --calls 3 --modules "engine|policy|lookup|sampling|costmodel|entropy"
    python bench/results/cpu-amx-s50/plain_profile.py --batch 16 --dtype bfloat16 --calls 2
"""
import argparse, cProfile, io, pstats, statistics, time, warnings

import torch

from heterospec import Engine
from heterospec.datasets import load_prompts

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=2)
ap.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16"])
ap.add_argument("--passes", type=int, default=0)
ap.add_argument("--calls", type=int, default=2)
ap.add_argument("--modules", default=".*", help="regex of heterospec modules the profile prints")
args = ap.parse_args()
warnings.simplefilter("ignore")
METHODS = ("autoregressive", "heterospec")
eng = Engine.from_pretrained(device="cpu", dtype=getattr(torch, args.dtype) if args.dtype else None)
prompts = [p.text for p in load_prompts("mtbench", args.batch)]
for m in METHODS:
    eng.generate_batch(prompts, max_new_tokens=96, method=m)
if args.passes:
    walls = {m: [] for m in METHODS}
    for _ in range(args.passes):
        for m in METHODS:
            t = time.perf_counter()
            eng.generate_batch(prompts, max_new_tokens=96, method=m)
            walls[m].append(time.perf_counter() - t)
    ar, hs = (statistics.median(walls[m]) for m in METHODS)
    print(f"B={args.batch} median wall AR {ar:.3f}s HS {hs:.3f}s HS/AR time {hs / ar:.3f}; per-pass ratios",
          [round(h / a, 3) for h, a in zip(walls["heterospec"], walls["autoregressive"])])
for m in METHODS if args.calls else ():
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        eng.generate_batch(prompts, max_new_tokens=96, method=m)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(rf"heterospec/({args.modules})", 45)
    print("=====", m)
    print(out.getvalue()[:9000])
