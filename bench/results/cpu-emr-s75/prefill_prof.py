"""Prefill time per method, one process (humaneval prompt 3, best of 4, AVX2 cap in the environment), then a torch profile of one heterospec call. Usage: python prefill_prof.py"""
import torch, time, heterospec, statistics
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
e = heterospec.Engine.from_pretrained()
p = [q.text for q in load_prompts("humaneval", n=4)][3]
for m in ("autoregressive", "heterospec"):
    e.generate(p, max_new_tokens=2, method=m)
res = {m: [] for m in ("autoregressive", "heterospec", "eagle3")}
for i in range(4):
    for m in res:
        r = e.generate(p, max_new_tokens=2, method=m)
        res[m].append(r.stats.prefill_s)
print({m: round(1e3*min(v), 1) for m, v in res.items()}, "prompt tokens", len(e.tokenizer(p)["input_ids"]) if callable(e.tokenizer) else "")
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    e.generate(p, max_new_tokens=2, method="heterospec")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
