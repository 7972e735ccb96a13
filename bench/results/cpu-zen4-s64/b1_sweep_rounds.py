import torch, sys, glob, os
for f in glob.glob(os.path.expanduser("~/.cache/heterospec/costs/*.online-*")): os.remove(f)
from heterospec import Engine, policy as P
from heterospec.bench import load_prompt_sets, batch_sweep
log = []
orig = P.FittedPolicy.observe
def obs(self, plan, bins, accepted, seconds=None, **kw):
    if plan.speculate:
        e = (plan.expected or {}).get("speculative") or {}
        log.append((round(1e3 * seconds, 2) if seconds else None, round(e.get("ms", 0) / (plan.expected or {}).get("time_scale", 1), 2),
                    kw.get("extend_tokens"), round(1e3 * kw.get("one_off_s", 0), 2), list(accepted), plan.max_nodes, kw.get("batch_size"), kw.get("context"), (plan.expected or {}).get("context")))
    return orig(self, plan, bins, accepted, seconds, **kw)
P.FittedPolicy.observe = obs
sets = load_prompt_sets(["mtbench", "alpaca"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
eng = Engine.from_pretrained()
batch_sweep(eng, prompts, batch_sizes=[1], methods=["heterospec", "autoregressive"], max_new_tokens=96, out_dir="/tmp/s64/res/x", repeats=2, prompts_per_size=16, progress=False)
print("(round ms, predicted unscaled, extend, one_off, accepted, max_nodes, B, context, plan context)")
for r in log[:80]: print(r)
pol = list(eng._fitted.values())[0]
print("time", pol._time, pol._time_used)
print("position_scale", pol.position_scale(), "bin_scale", {k: v for k, v in pol.bin_scale().items() if any(x != 1.0 for x in v)})
fp = pol.fitted_plan(1, 300)
print("fitted speculate", fp.speculate, "guard loses", pol.realized_loses(1), "realized", pol.realized(1))
alt = fp if fp.speculate else fp.alternative
print("spec expected", alt.expected.get("speculative"), "plain", fp.expected.get("plain"))
print("plain_ahead", pol._plain_ahead)
