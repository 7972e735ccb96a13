"""Observed / predicted acceptance of the shipped tables, per prompt source: every round the fitted
speculative plan (ForcedPolicy speculate=True, no lookup), unforgotten sums of P(accepted >= j) per
draft position j against the tables' survival for the round's bin and action.
Usage: python accept_scale.py N TOKENS SOURCE..."""
import json, sys, torch, heterospec
from heterospec import policy as P
from heterospec.datasets import load_prompts
from heterospec.train.prompts import calibration_prompts, build_training_prompts
torch.set_num_threads(2)
n, tokens, sources = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
sums = {}
orig = P.FittedPolicy.observe
def obs(self, plan, bins, accepted, seconds=None, drafted=None, **kw):
    if plan.speculate and plan.survival is not None:
        s = sums.setdefault("cur", {"obs": [0.0] * 8, "pred": [0.0] * 8, "rounds": 0, "acc": 0.0})
        for r, (b, a) in enumerate(zip(bins, accepted)):
            m = len(plan.survival[b]) if drafted is None else int(drafted[r])
            for j, sj in enumerate(plan.survival[b][:m]):
                s["obs"][j] += 1.0 if a > j else 0.0
                s["pred"][j] += sj
            s["rounds"] += 1; s["acc"] += a
    return orig(self, plan, bins, accepted, seconds=seconds, drafted=drafted, **kw)
P.FittedPolicy.observe = obs
e = heterospec.Engine.from_pretrained()
cfg = e.config
out = {}
for src in sources:
    if src == "calib":
        texts = calibration_prompts(n)[0]
    elif src.startswith("train:"):
        texts = [p.text for p in build_training_prompts(4 * n, seed=7, mix={src[6:]: 1.0})][-n:]
    else:
        texts = [p.text for p in load_prompts(src, n=n + 4)][4:]      # not the benchmark's prompts 0-3
    pol = P.ForcedPolicy(e.tables_for(cfg.top_k), e.cost_model, cfg, speculate=True, ragged=e.ragged_verify)
    sums.pop("cur", None)
    for t in texts:
        e.generate(t, max_new_tokens=tokens, method="heterospec", policy=pol, lookup=False)
    s = sums["cur"]
    ratio = [round(o / p, 3) if p > 0 else None for o, p in zip(s["obs"], s["pred"])]
    out[src] = {"ratio": ratio, "obs": s["obs"], "pred": s["pred"], "rounds": s["rounds"], "mean_accept": s["acc"] / max(s["rounds"], 1)}
    print(src, "rounds", s["rounds"], "mean accepted %.2f" % out[src]["mean_accept"], "obs/pred per position", ratio[:5],
          "pred weight", [round(p, 1) for p in s["pred"][:5]], flush=True)
json.dump(out, open(f"accept_scale_{n}.json", "w"), indent=1)
