"""Batch 1, fresh online state: heterospec against autoregressive (alternated per prompt) on the
first four prompts of MT-bench and HumanEval, with the round kinds HeteroSpec chose. Run by
sets_first_step_ab.sh with the shipped engine and with the first plain step after the prefill
timed (the code before)."""
import collections, time
import torch
from heterospec import Engine
from heterospec.bench import bench_call, load_prompt_sets
torch.set_num_threads(2)
eng = Engine.from_pretrained()
for name, ps in load_prompt_sets(["mtbench", "humaneval"], 4, 0).items():
    t, kinds = collections.Counter(), collections.Counter()
    for i, p in enumerate(ps):
        for m in (("autoregressive", "heterospec") if i % 2 == 0 else ("heterospec", "autoregressive")):
            s = time.perf_counter(); out = eng.generate(p.text, max_new_tokens=128, **bench_call(m)); t[m] += time.perf_counter() - s
            if m == "heterospec":
                for r in out.stats.records:
                    kinds["plain" if r.plain else "lookup" if r.lookup else "speculative"] += 1
    print(f"{name:9s} heterospec / autoregressive {t['autoregressive'] / t['heterospec']:.3f}", dict(kinds))
