"""cProfile of 2 batch-B calls each of autoregressive and heterospec (the first B MT-bench prompts x 96
tokens, after a warm-up call each; the target in the given dtype), every heterospec module (fiftieth session).
    python bench/results/cpu-amx-s50/plain_b16_profile.py 16 bfloat16
"""
import time, cProfile, pstats, io, sys, warnings
warnings.simplefilter("ignore")
from heterospec import Engine
from heterospec.datasets import load_prompts
B = int(sys.argv[1]) if len(sys.argv) > 1 else 2
import torch; eng = Engine.from_pretrained(device="cpu", dtype=getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else None)
ps = [p.text for p in load_prompts("mtbench", B)]
for m in ("autoregressive", "heterospec"):
    eng.generate_batch(ps, max_new_tokens=96, method=m)
for m in ("autoregressive", "heterospec"):
    pr = cProfile.Profile(); pr.enable()
    for _ in range(2): eng.generate_batch(ps, max_new_tokens=96, method=m)
    pr.disable(); s = io.StringIO(); st = pstats.Stats(pr, stream=s)
    st.sort_stats("cumulative").print_stats(r"heterospec/", 40); print("=====", m); print(s.getvalue()[:9000])
