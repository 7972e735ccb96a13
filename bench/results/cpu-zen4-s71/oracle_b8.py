"""What a perfect-foresight drafting policy could reach in vLLM at batch 8 (or 1) with the shipped draft.

`python oracle_b8.py DIR [B]`: B = 8 (default) reads `eagle3_k5_b8_spec.json`, B = 1
`eagle3_k5_b1_spec.json` (vLLM eagle3 K=5 on the first 8 MT-bench prompts at batch 1).

Inputs, both measured on the Zen 4 box this session:
- vLLM eagle3 K=5 at batch 8 on the 32 MT-bench prompts (continuous): per draft position, the
  drafts whose token there was accepted (`eagle3_k5_b8_spec.json`), so P(L >= j) for a request's
  accepted length L under a 5-token chain;
- the step costs vLLM + HeteroSpec learned over its runs (`step_costs_b8.json`, StepCosts): the
  plain step, the speculative line (ms per draft token per request) and the draft line.
The oracle drafts for each request exactly the tokens the target will accept (never a rejected
one) and runs as many draft forwards as the batch's longest chain; requests draw L independently.
Fixed K drafts K tokens for every request. Ratios are tokens per ms against a plain step without
the warm draft forward (vLLM autoregressive). No speculative overhead of vLLM is left out: the
speculative line was fitted on whole steps.
"""
import json, random, sys
from heterospec.vllm_plugin.costs import StepCosts

here = sys.argv[1] if len(sys.argv) > 1 else "."
B = int(sys.argv[2]) if len(sys.argv) > 2 else 8
spec = json.load(open(f"{here}/eagle3_k5_b{B}_spec.json"))["spec"]
c = StepCosts.load(f"{here}/step_costs_b8.json")
n = spec["num_drafts"]
surv = [a / n for a in spec["num_accepted_tokens_per_pos"]]          # P(L >= j), j = 1..5
plain = c.plain_level(B)
slope, draft_slope = c.slopes(B)          # ms per draft token per request; ms per draft forward after the first
first = c.draft_ms(B, 0)                  # the draft's first forward
ar = B / plain

def fixed(k):
    acc = sum(surv[:k])
    return B * (1 + acc) / (plain + slope * k + first + draft_slope * (k - 1))

def draw():
    u, L = random.random(), 0
    while L < len(surv) and u < surv[L]:
        L += 1
    return L

random.seed(0)
tok = ms = 0.0
for _ in range(20000):
    Ls = [draw() for _ in range(B)]
    fw = max(Ls)
    tok += B + sum(Ls)
    ms += plain + slope * sum(Ls) / B + (first + draft_slope * (fw - 1) if fw else 0.0)
oracle = tok / ms
print(f"P(L >= j), j = 1..5: {[round(x, 3) for x in surv]} (conditional: "
      f"{[round(surv[0], 3)] + [round(surv[j] / surv[j - 1], 3) for j in range(1, 5)]})")
print(f"step costs at batch {B}: plain {plain:.1f} ms, {slope:.1f} ms per draft token per request, "
      f"draft first forward {first:.1f} ms, +{draft_slope:.1f} ms per further forward")
best = max(range(1, 6), key=fixed)
for k in range(1, 6):
    print(f"fixed K={k}: {fixed(k) / ar:.3f}x autoregressive")
print(f"oracle: {oracle / ar:.3f}x autoregressive, {oracle / fixed(best):.3f}x the best fixed K (K={best})")
