"""Which rounds of a batch-B heterospec call speculate, and what the probe schedule said (fifty-first session):
    python bench/results/cpu-amx-s51/probe_schedule.py 16 bfloat16 8      # batch, dtype, calls
"""
import torch
from heterospec import Engine
from heterospec.policy import FittedPolicy as FP
from heterospec.datasets import load_prompts
warnings.simplefilter("ignore")
B = int(sys.argv[1]); dtype = sys.argv[2]; calls = int(sys.argv[3])
eng = Engine.from_pretrained(device="cpu", dtype=getattr(torch, dtype))
prompts = [p.text for p in load_prompts("mtbench", B)]
orp = FP.round_plan
state = {"r": 0}
def rp(self, bs, context=None, **kw):
    b = self.bucket(bs)
    before = (self._since_probe.get(b, 0), self._backoff.get(b, 0), self._burst.get(b, 0))
    p = orp(self, bs, context, **kw)
    state["r"] += 1
    if p.speculate:
        plan = self.plan(bs, context)
        print(f"  round {state['r']} bucket {b} SPEC since/backoff/burst before {before} spacing {self._probe_spacing(b, plan) if not plan.speculate else '-'} "
              f"pred {self._predicted_probe_loss(plan):.0f} meas {self._measured_probe_loss(b):.0f} plan.speculate {plan.speculate} budget {p.budget}", flush=True)
    return p
FP.round_plan = rp
for c in range(calls):
    state["r"] = 0
    t = time.perf_counter()
    eng.generate_batch(prompts, max_new_tokens=96, method="heterospec")
    print(c, f"wall {time.perf_counter() - t:.3f}", flush=True)
