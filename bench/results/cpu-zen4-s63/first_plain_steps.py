"""Six batch-1 calls from the saved online state: the plain steps the policy timed, by their index
in the call (the first is the one right after the prefill), and the guard of bucket 1 after each."""
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
    log.append(("spec" if plan.speculate else "plain", round(seconds * 1e3, 2) if seconds else None, kw.get("context")))
    return orig(plan, bins, acc, seconds, **kw)
pol.observe = obs
for p in prompts[:6]:
    log.clear()
    r0 = pol._realized.get(1)
    eng.generate_batch([p], max_new_tokens=96, **bench_call("heterospec"))
    pl = [(i, x[1]) for i, x in enumerate(log) if x[0] == "plain"]
    r = pol._realized.get(1)
    print("rounds", len(log), "plain obs (index, ms)", pl[:10], "guard plain ms/step %.2f" % (1e3 * r[4] / r[5]))
