"""cProfile of 3 batch-2 calls each of autoregressive and heterospec (the first 2 MT-bench prompts x 96
tokens, after a warm-up call each), restricted to the engine, policy, lookup and sampling modules (fiftieth session).
    python bench/results/cpu-amx-s50/plain_b2_rounds_profile.py [B]
"""
import time, cProfile, pstats, io, sys, warnings
warnings.simplefilter("ignore")
from heterospec import Engine
from heterospec.datasets import load_prompts
B = int(sys.argv[1]) if len(sys.argv) > 1 else 2
eng = Engine.from_pretrained(device="cpu")
ps = [p.text for p in load_prompts("mtbench", B)]
for m in ("autoregressive", "heterospec"):
    eng.generate_batch(ps, max_new_tokens=96, method=m)
for m in ("autoregressive", "heterospec"):
    pr = cProfile.Profile(); pr.enable()
    for _ in range(3): eng.generate_batch(ps, max_new_tokens=96, method=m)
    pr.disable(); s = io.StringIO(); st = pstats.Stats(pr, stream=s)
    st.sort_stats("cumulative").print_stats(r"heterospec/(engine|policy|lookup|sampling|costmodel|entropy)", 45); print("=====", m); print(s.getvalue()[:9000])
