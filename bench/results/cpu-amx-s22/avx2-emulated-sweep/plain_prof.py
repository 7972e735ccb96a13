import cProfile, pstats, time, io, sys
import torch, heterospec
from heterospec.bench import load_prompt_sets
from heterospec.policy import Plan, Policy
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(device="cpu", dtype=torch.float32, draft_dtype=torch.float32)
sets = load_prompt_sets(["mtbench", "alpaca"], 4, 0)
prompts = [p.text for p in sets["mtbench"]] + [p.text for p in sets["alpaca"]]
class PlainWithDraft(Policy):
    def plan(self, b, context=None): return Plan("plain", speculate=False)
    def needs_draft(self, b): return True
    def max_tree_nodes(self, b): return 8
cases = {"ar": dict(method="autoregressive"), "plain+draft": dict(method="heterospec", policy=PlainWithDraft())}
for kw in cases.values(): eng.generate_batch(prompts, max_new_tokens=8, **kw)
profs = {k: cProfile.Profile() for k in cases}
times = {k: [] for k in cases}
for rep in range(4):
    for k, kw in (list(cases.items()) if rep % 2 == 0 else list(cases.items())[::-1]):
        t = time.perf_counter()
        profs[k].enable(); out = eng.generate_batch(prompts, max_new_tokens=96, **kw); profs[k].disable()
        times[k].append(time.perf_counter() - t)
for k in cases:
    print("=====", k, [round(x, 2) for x in times[k]])
    s = io.StringIO(); pstats.Stats(profs[k], stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[-4200:])
