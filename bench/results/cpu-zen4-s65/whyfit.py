import torch, time, sys
import heterospec.policy as P
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
orig = P.fit_plan
log = []
def fp(tables, cost, b, c, ragged, **kw):
    t = time.perf_counter(); r = orig(tables, cost, b, c, ragged, **kw); dt = time.perf_counter() - t
    log.append((b, c, kw.get("options") is None, round(1e3 * dt, 2), kw["position_scale"][:3], kw["time_scale"], kw["plain_scale"]))
    return r
P.fit_plan = fp
eng = Engine.from_pretrained(dtype="bfloat16")
sets = load_prompt_sets(["mtbench"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
for m in ("heterospec", "autoregressive"):
    eng.generate_batch(prompts[:8], max_new_tokens=32, **bench_call(m))
print("warm-up fits", len(log)); log.clear()
for g in (0, 8, 0, 8):
    r = eng.generate_batch(prompts[g:g + 8], max_new_tokens=96, **bench_call("heterospec"))
    print("call", g, "fits:", log); log.clear()
