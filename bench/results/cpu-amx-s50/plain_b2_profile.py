"""Batch 2, the first 2 MT-bench prompts x 96 tokens: autoregressive and heterospec calls taking turns
(6 passes after a warm-up call each), then a cProfile of 2 calls of each (fiftieth session).
    python bench/results/cpu-amx-s50/plain_b2_profile.py [B]
"""
import time, cProfile, pstats, io, sys, statistics as st, warnings
warnings.simplefilter("ignore")
from heterospec import Engine
from heterospec.datasets import load_prompts
B = int(sys.argv[1]) if len(sys.argv) > 1 else 2
eng = Engine.from_pretrained(device="cpu")
ps = [p.text for p in load_prompts("mtbench", B)]
for m in ("autoregressive", "heterospec"):
    eng.generate_batch(ps, max_new_tokens=96, method=m)
walls = {"autoregressive": [], "heterospec": []}
for r in range(6):
    for m in ("autoregressive", "heterospec"):
        t = time.perf_counter(); out = eng.generate_batch(ps, max_new_tokens=96, method=m); walls[m].append(time.perf_counter() - t)
ar, hs = st.median(walls["autoregressive"]), st.median(walls["heterospec"])
print(f"B={B} median wall AR {ar:.3f}s HS {hs:.3f}s HS/AR time {hs/ar:.3f}; per-pass ratios", [round(h/a, 3) for h, a in zip(walls["heterospec"], walls["autoregressive"])])
for m in ("autoregressive", "heterospec"):
    pr = cProfile.Profile(); pr.enable()
    for _ in range(2): eng.generate_batch(ps, max_new_tokens=96, method=m)
    pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print("=====", m); print(s.getvalue()[:6000])
