"""The guard's plain probes against steady plain steps: bfloat16 target, batch 2 (the sweep's
first two prompts x 96 tokens): each plain step heterospec's policy observes (its seconds and the
round before it), and autoregressive's steps of the same batch timed alike."""
import sys, time, torch
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.bfloat16
B = int(sys.argv[2]) if len(sys.argv) > 2 else 2
eng = Engine.from_pretrained(dtype=dtype)
sets = load_prompt_sets(["mtbench", "alpaca"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps][:B]
eng.generate_batch(prompts, max_new_tokens=8, **bench_call("heterospec"))
pol = eng._policy("heterospec", eng.config, eng.policy)
log = []
orig = pol.observe
def obs(plan, bins, acc, seconds, **kw):
    log.append((plan.speculate, seconds))
    return orig(plan, bins, acc, seconds, **kw)
pol.observe = obs
f = eng._decode_one
ar = []
def g(*a, **k):
    t = time.perf_counter(); r = f(*a, **k); ar.append(time.perf_counter() - t); return r
for rep in range(2):
    log.clear()
    eng.generate_batch(prompts, max_new_tokens=96, **bench_call("heterospec"))
    probes = [(i, s) for i, (sp, s) in enumerate(log) if not sp and s]
    after_spec = [s for i, s in probes if i > 0 and log[i - 1][0]]
    after_plain = [s for i, s in probes if i > 0 and not log[i - 1][0]]
    spec = [s for sp, s in log if sp and s]
    eng._decode_one = g; ar.clear()
    eng.generate_batch(prompts, max_new_tokens=96, **bench_call("autoregressive"))
    eng._decode_one = f
    med = lambda v: sorted(v)[len(v) // 2] if v else float("nan")
    print("rep %d: plain steps after a speculative round %d, median %.2f ms; after a plain step %d, median %.2f ms; "
          "speculative rounds %d, median %.2f ms; autoregressive steps %d, median %.2f ms"
          % (rep, len(after_spec), 1e3 * med(after_spec), len(after_plain), 1e3 * med(after_plain), len(spec),
             1e3 * med(spec), len(ar), 1e3 * med(ar)))
