"""Cold-state trace: heterospec (and autoregressive, interleaved) over SETS x N prompts x 128 tokens from
the current HETEROSPEC_CACHE; per call the guard's verdict, the scales and the plan; per round what observe saw."""
import json, sys, time, torch, heterospec
from heterospec import policy as P
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
sets, n, out = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
rounds = []
orig = P.FittedPolicy.observe
def obs(self, plan, bins, accepted, seconds=None, **kw):
    exp = plan.expected or {}
    rounds.append({"spec": plan.speculate, "s": seconds, "acc": list(accepted) if plan.speculate else None,
                   "bins": list(bins) if plan.speculate else None, "budget": plan.budget, "depth": plan.depth,
                   "pred_ms": (exp.get("speculative" if plan.speculate else "plain") or {}).get("ms"),
                   "pred_tok": (exp.get("speculative") or {}).get("tokens"), "pred_plain_ms": (exp.get("plain") or {}).get("ms"),
                   "one_off_s": kw.get("one_off_s", 0.0), "extend": kw.get("extend_tokens")})
    return orig(self, plan, bins, accepted, seconds=seconds, **kw)
P.FittedPolicy.observe = obs
import os
e = heterospec.Engine.from_pretrained(os.path.expanduser("~/.cache/heterospec/smollm2-135m-instruct"), os.environ["DRAFT"]) if os.environ.get("DRAFT") else heterospec.Engine.from_pretrained()
for m in ("autoregressive", "eagle3", "heterospec"):
    e.generate(load_prompts(sets[0], n=1)[0].text, max_new_tokens=8, method=m)
pol = e._policy("heterospec", e.config, "fitted")
calls = []
for s in sets:
    for i, p in enumerate(load_prompts(s, n=n)):
        row = {"set": s, "id": p.id}
        for m in (("autoregressive", "heterospec") if i % 2 == 0 else ("heterospec", "autoregressive")):
            rounds.clear()
            r = e.generate(p.text, max_new_tokens=128, method=m)
            row[m] = {"tok_s": r.stats.tokens_per_s, "tau": r.stats.tau, "calls": r.stats.target_calls,
                      "verify_s": r.stats.verify_s, "draft_s": r.stats.draft_s, "total_s": r.stats.total_s}
            if m == "heterospec":
                row["rounds"] = list(rounds)
                v = pol._verdict(1)
                pl = pol.plan(1)
                row["after"] = {"verdict": v, "time_scale": pol.time_scale(1), "plain_scale": pol.plain_scale(1),
                                "position_scale": pol.position_scale(), "speculate": pl.speculate,
                                "budget": pl.budget, "depth": pl.depth, "expected": pl.expected}
        calls.append(row)
        a, h = row["autoregressive"], row["heterospec"]
        sp = [x for x in row["rounds"] if x["spec"]]
        print(f"{s} {p.id}: hs/ar {h['tok_s']/a['tok_s']:.3f} tau {h['tau']:.2f} spec rounds {len(sp)}/{len(row['rounds'])} "
              f"verdict {row['after']['verdict']} ts {row['after']['time_scale']} ps {row['after']['plain_scale']} "
              f"pos {row['after']['position_scale'][:3]}", flush=True)
json.dump(calls, open(out, "w"), default=str)
