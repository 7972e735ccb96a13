"""Where HeteroSpec's plain mode loses to autoregressive decoding at a batch size where it does not
speculate (issue 10): autoregressive vs HeteroSpec (fitted policy) vs a policy that is always plain
but keeps the draft's bookkeeping (taps, pending extend), interleaved in one process.

    python bench/plain_mode_ab.py        # batch 8 (4 MT-bench + 4 Alpaca prompts), 96 tokens, 4 passes
"""
import time, torch, heterospec, statistics
from heterospec.policy import Policy, Plan
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(device="cpu", dtype=torch.float32)
from heterospec.bench import load_prompt_sets
prompts = [p.text for p in load_prompt_sets(["mtbench", "alpaca"], 4, 0)["mtbench"]] + \
          [p.text for p in load_prompt_sets(["alpaca"], 4, 0)["alpaca"]]
class PlainWithDraft(Policy):
    """Always plain, but keeps the draft's bookkeeping (taps, pending extend), as a plain bucket does."""
    def plan(self, b, context=None): return Plan("plain", speculate=False)
    def needs_draft(self, b): return True
    def max_tree_nodes(self, b): return 8
cases = [("ar", dict(method="autoregressive")), ("hs", dict(method="heterospec")),
         ("plain+draft", dict(method="heterospec", policy=PlainWithDraft()))]
for name, kw in cases:
    eng.generate_batch(prompts, max_new_tokens=8, **kw)
res = {n: [] for n, _ in cases}
for rep in range(4):   # order reversed every other pass
    for name, kw in (cases if rep % 2 == 0 else cases[::-1]):
        t0 = time.perf_counter(); out = eng.generate_batch(prompts, max_new_tokens=96, **kw); dt = time.perf_counter() - t0
        res[name].append(sum(len(o.token_ids) for o in out) / dt)
for n, v in res.items():
    print(n, [round(x, 1) for x in v], "median", round(statistics.median(v), 1), "ratio",
          round(statistics.median([a / b for a, b in zip(v, res["ar"])]), 3))
