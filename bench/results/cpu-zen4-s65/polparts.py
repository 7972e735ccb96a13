import torch, time, sys, collections
from heterospec import Engine
from heterospec.policy import FittedPolicy
from heterospec.lookup import LookupGate
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
acc = collections.Counter(); cnt = collections.Counter()
def wrap(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[cls.__name__ + "." + name] += time.perf_counter() - t; cnt[cls.__name__ + "." + name] += 1; return r
    setattr(cls, name, g)
for n in ("round_plan", "observe", "fitted_plan", "_repays", "bin_scale", "bin_frequencies", "position_scale", "plan"):
    wrap(FittedPolicy, n)
for n in ("choose", "observe", "observe_plain", "due"):
    wrap(LookupGate, n)
wrap(Engine, "_lookup_choice"); wrap(Engine, "_lookup_proposals")
eng = Engine.from_pretrained(dtype=sys.argv[1] if len(sys.argv) > 1 else None)
sets = load_prompt_sets(["mtbench", "humaneval"], 4, 0)
prompts = [p.text for ps in sets.values() for p in ps]
eng.generate(prompts[0], max_new_tokens=16, **bench_call("heterospec"))
acc.clear(); cnt.clear()
steps = 0; pol = 0.0
for p in prompts:
    r = eng.generate(p, max_new_tokens=96, **bench_call("heterospec")); steps += len(r.stats.records); pol += r.stats.policy_s
print("steps", steps, "policy_s per step %.1f us" % (1e6 * pol / steps))
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print("%-32s %6d calls %8.1f us/call %7.1f us/step" % (k, cnt[k], 1e6 * v / cnt[k], 1e6 * v / steps))
for k, pol in eng._fitted.items():
    print(k, "fits", pol._fits, "fit_s %.4f" % pol._fit_s, "round_s %.3f" % pol._round_s)
