import time, sys, collections, torch
import heterospec
from heterospec.bench import load_prompt_sets
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(device="cpu", dtype=torch.float32)
B = int(sys.argv[1]) if len(sys.argv) > 1 else 2
sets = load_prompt_sets(["mtbench"], B, 0)
prompts = [p.text for p in sets["mtbench"]]
T = collections.defaultdict(float); N = collections.Counter()
def wrap(obj, name, label):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[label] += time.perf_counter() - t; N[label] += 1; return r
    setattr(obj, name, g)
for n in ["_decode_one", "_plain_step", "_prefill", "_emit", "_draft_half", "_verify_half", "_commit"]: wrap(eng, n, n)
wrap(eng.target, "forward", "target.forward"); wrap(eng.draft, "extend", "draft.extend")
pol = eng._policy("heterospec", eng.config)
for m in ["round_plan", "plan", "observe"]: wrap(pol, m, "pol." + m)
for rep in range(2):
  for m in ["autoregressive", "heterospec"]:
    eng.generate_batch(prompts, max_new_tokens=8, method=m)
    T.clear(); N.clear()
    t0 = time.perf_counter(); eng.generate_batch(prompts, max_new_tokens=96, method=m); w = time.perf_counter() - t0
    d = T["_decode_one"] - T["_plain_step"]
    loop = w - T["_prefill"] - T["_decode_one"] - T["_draft_half"] - T["_verify_half"] - T["_commit"]
    print(m, f"wall {w*1e3:.0f} prefill {T['_prefill']*1e3:.1f} (draft.extend {T['draft.extend']*1e3:.1f}) steps {N['_decode_one']} step {T['_plain_step']/max(N['_plain_step'],1)*1e3:.3f} ms, decode_one extra {d/max(N['_decode_one'],1)*1e6:.0f} us, loop rest {loop/max(N['_decode_one'],1)*1e6:.0f} us/step, policy {(T['pol.round_plan']+T['pol.observe']+ (T['pol.plan'] if N['pol.round_plan']==0 else 0))/max(N['_decode_one'],1)*1e6:.0f} us/step, spec rounds {N['_verify_half']}")
