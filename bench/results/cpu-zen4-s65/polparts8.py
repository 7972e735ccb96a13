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
for n in ("round_plan", "observe", "fitted_plan", "plan", "plain_rounds_ahead"):
    wrap(FittedPolicy, n)
for n in ("choose", "observe", "observe_plain", "due"):
    wrap(LookupGate, n)
wrap(Engine, "_lookup_choice"); wrap(Engine, "_lookup_proposals"); wrap(Engine, "_compaction_pays")
eng = Engine.from_pretrained(dtype="bfloat16")
sets = load_prompt_sets(["mtbench"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
for m in ("heterospec", "autoregressive"):
    eng.generate_batch(prompts[:8], max_new_tokens=32, **bench_call(m))
acc.clear(); cnt.clear(); pol0 = next(iter(eng._fitted.values())); f0, n0 = pol0._fit_s, pol0._fits
steps = 0; pol = 0.0
for g in (0, 8, 0, 8):
    r = eng.generate_batch(prompts[g:g + 8], max_new_tokens=96, **bench_call("heterospec")); steps += r[0].stats.target_calls; pol += r[0].stats.policy_s
print("steps", steps, "policy_s per step %.1f us" % (1e6 * pol / steps))
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print("%-32s %6d calls %8.1f us/call %7.1f us/step" % (k, cnt[k], 1e6 * v / cnt[k], 1e6 * v / steps))
print("fits", pol0._fits - n0, "fit_s %.4f" % (pol0._fit_s - f0))
