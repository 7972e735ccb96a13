"""Batch 1 on 8 MT-bench prompts from the saved online state: every policy observation logged (kind,
seconds, context), the guard of bucket 1 before and after, and the plan it fits."""
import torch, time, collections, statistics
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
eng = Engine.from_pretrained()
prompts = [p.text for ps in load_prompt_sets(["mtbench"], 16, 0).values() for p in ps]
pol = eng._policy("heterospec", eng.config, eng.policy)
log = []
orig = pol.observe
def obs(plan, bins, acc, seconds, **kw):
    log.append((plan.speculate, seconds, sum(acc) if acc else 0, kw.get("context"), kw.get("extend_tokens")))
    return orig(plan, bins, acc, seconds, **kw)
pol.observe = obs
print("start realized[1]", [round(x, 3) for x in pol._realized.get(1, [])])
t = collections.Counter()
for i, p in enumerate(prompts[:8]):
    for m in (("autoregressive", "heterospec") if i % 2 == 0 else ("heterospec", "autoregressive")):
        s = time.perf_counter(); eng.generate_batch([p], max_new_tokens=96, **bench_call(m)); t[m] += time.perf_counter() - s
print("HS/AR speed %.3f" % (t["autoregressive"] / t["heterospec"]))
sp = [x for x in log if x[0] and x[1]]; pl = [x for x in log if not x[0] and x[1]]; pu = [x for x in log if not x[0] and not x[1]]
print("spec rounds", len(sp), "mean %.2f ms" % (1e3 * statistics.mean(x[1] for x in sp)) if sp else "", "acc/round %.2f" % (sum(x[2] for x in sp) / max(1, len(sp))))
print("plain timed", len(pl), "mean %.2f ms" % (1e3 * statistics.mean(x[1] for x in pl)) if pl else "", "untimed", len(pu))
print("plain timed ms", [round(1e3 * x[1], 1) for x in pl][:40])
print("end realized[1]", [round(x, 3) for x in pol._realized.get(1, [])])
print("plan(1) speculate", pol.plan(1).speculate, "expected", pol.plan(1).expected)
