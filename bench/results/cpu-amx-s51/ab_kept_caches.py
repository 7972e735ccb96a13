"""Kept CPU KV caches on/off, interleaved: AR and HS walls per mode (fifty-first session). "kept" is
Engine._new_cache as of commit 0bc0782 (CPU engines kept their caches between calls; reverted in
ab2f7e2): on later code both modes allocate per call.
    python bench/results/cpu-amx-s51/ab_kept_caches.py bfloat16 16 4      # dtype, batch, passes
"""
import sys, time, warnings, statistics
import torch
import heterospec.engine as HE
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
warnings.simplefilter("ignore")
dtype = sys.argv[1]; B = int(sys.argv[2]); passes = int(sys.argv[3])
eng = Engine.from_pretrained(device="cpu", dtype=getattr(torch, dtype))
sets = load_prompt_sets(["mtbench", "alpaca"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps][:B]
kept_new_cache = HE.Engine._new_cache
def fresh_new_cache(self, model, batch_size, length):
    return model.new_cache(batch_size, length)
walls = {}
for p in range(passes + 1):
    for mode in ("kept", "fresh"):
        HE.Engine._new_cache = kept_new_cache if mode == "kept" else fresh_new_cache
        for m in ("autoregressive", "heterospec") if p % 2 else ("heterospec", "autoregressive"):
            t = time.perf_counter(); eng.generate_batch(prompts, max_new_tokens=96, **bench_call(m)); w = time.perf_counter() - t
            if p: walls.setdefault((mode, m), []).append(w)
for k, v in sorted(walls.items()): print(B, dtype, k, "median %.3f" % statistics.median(v), [round(x, 2) for x in v])
for mode in ("kept", "fresh"):
    r = [a / h for a, h in zip(walls[(mode, "autoregressive")], walls[(mode, "heterospec")])]
    print(B, dtype, mode, "HS/AR speed per pass", [round(x, 3) for x in r], "median %.3f" % statistics.median(r))
print(B, dtype, "kept/fresh time AR %.3f HS %.3f" % tuple(statistics.median(walls[("kept", m)]) / statistics.median(walls[("fresh", m)]) for m in ("autoregressive", "heterospec")))
