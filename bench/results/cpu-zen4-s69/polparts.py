import time, torch, heterospec, sys
from heterospec.bench import load_prompt_sets
from heterospec import policy as PO
import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'cpu-zen4-s67'))
from clocks import Timers
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(dtype=getattr(torch, sys.argv[1]))
T = Timers()
for n in ["plan", "fitted_plan", "round_plan", "observe", "position_scale", "time_scale", "plain_scale", "bin_frequencies",
          "bin_scale", "_as_key", "realized_loses", "_verdict", "realized", "refit", "_speculative_prior", "held_plain", "plain_rounds_ahead",
          "_repays", "_burst_loss", "_probe_spacing"]:
    if hasattr(PO.FittedPolicy, n): T.wrap(PO.FittedPolicy, n, n)
T.wrap(PO, "fit_plan", "fit_plan")
sets = load_prompt_sets(["mtbench", "alpaca"], 8)
ps = [p.text for s in sets.values() for p in s]
eng.generate(ps[0], max_new_tokens=16)
T.clear(); rounds = 0
for p in ps:
    r = eng.generate(p, max_new_tokens=96); rounds += len(r.stats.records)
for k, v in sorted(T.acc.items(), key=lambda kv: -kv[1]):
    print(f"  {k:22s} {1e6*v/rounds:8.1f} us/round  ({T.cnt[k]} calls, {1e6*v/max(T.cnt[k],1):.1f} us/call)")
