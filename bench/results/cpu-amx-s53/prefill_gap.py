"""A call's prefill as heterospec runs it when the call starts plain (the prompt's features kept,
a draft cache, a cache with tree slack, the draft's prompt pass deferred) against
autoregressive's, alternated on the same prompts (53rd session), and the same with the cache
lengths made equal (what the tree slack costs):
    python bench/results/cpu-amx-s53/prefill_gap.py float32 16 20
"""
import sys, time, statistics
import torch
from heterospec.config import SamplingParams
from heterospec.sampling import make_generator
from _setup import benchmark_prompts, engine
dtype, B, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = engine(dtype)
ids = [eng._encode(p, True) for p in benchmark_prompts()[:B]]
params, gen = SamplingParams(), make_generator(None, eng.device)
pol = eng._policy("heterospec", eng.config, "fitted")
base = max(map(len, ids)) + 96
slack = 2 * (pol.max_tree_nodes(B) + 1)
arms = {"ar": (False, base + 1), "hs": (True, base + slack + 1), "hs-same-len": (True, base + 1)}
t = {k: [] for k in arms}
with torch.inference_mode():
    for i in range(n):
        for k in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
            spec, length = arms[k]
            t0 = time.perf_counter()
            st = eng._prefill(ids, "heterospec" if spec else "autoregressive", params, gen, length, 96, None, spec,
                              defer_prompt=spec)
            t[k].append(time.perf_counter() - t0)
            del st
print("B=%d %s slack %d slots: ar prefill median %.1f ms" % (B, dtype, slack, 1e3 * statistics.median(t["ar"])))
for k in ("hs", "hs-same-len"):
    d = [1e3 * (h - a) for a, h in zip(t["ar"], t[k])]
    print("  %s - ar: median %+.1f ms (range %+.1f..%+.1f)" % (k, statistics.median(d), min(d), max(d)))
