import torch, time, collections
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
eng = Engine.from_pretrained()
sets = load_prompt_sets(["mtbench", "alpaca"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
eng.generate_batch(prompts[:1], max_new_tokens=8, **bench_call("heterospec"))
pol = eng._policy("heterospec", eng.config, eng.policy)
log = []
orig = pol.observe
def obs(plan, bins, acc, seconds, **kw):
    log.append((plan.speculate, seconds, sum(acc) if acc else None, kw.get("extend_tokens")))
    return orig(plan, bins, acc, seconds, **kw)
pol.observe = obs
for rep in range(2):
    log.clear()
    r = eng.generate_batch(prompts[:1], max_new_tokens=96, **bench_call("heterospec"))
    for i, (s, sec, a, ext) in enumerate(log):
        if not s or i < 4: print(i, "spec" if s else "plain", "%.2f ms" % (sec * 1e3) if sec else None, a, ext)
    sp = [x[1] for x in log if x[0] and x[1]]
    print("spec rounds", len(sp), "mean %.2f ms" % (1e3 * sum(sp) / len(sp)), "accepted", sum(x[2] for x in log if x[0]))
