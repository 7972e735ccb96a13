import time, sys, collections, torch
import heterospec
from heterospec.config import SpecConfig
from heterospec.bench import load_prompt_sets
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(device="cpu", dtype=torch.float32)
T = collections.defaultdict(float); N = collections.Counter()
def wrap(obj, name, label):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[label] += time.perf_counter() - t; N[label] += 1; return r
    setattr(obj, name, g)
wrap(eng.target, "forward", "target.forward")
for n in ["extend", "logits", "tree_step"]: wrap(eng.draft, n, "draft." + n)
for n in ["_draft_half", "_verify_half", "_commit", "_decode_one", "_prefill"]: wrap(eng, n, n)
sets = load_prompt_sets(["mtbench", "alpaca", "humaneval"], 2, 0)
prompts = [p.text for s in sets.values() for p in s]
cfg = SpecConfig(top_k=1, depth=0, total_tokens=2)
eng.generate(prompts[0], max_new_tokens=8, method="eagle3", config=cfg)
T.clear(); N.clear()
t0 = time.perf_counter(); tok = 0
for p in prompts: tok += len(eng.generate(p, max_new_tokens=96, method="eagle3", config=cfg).token_ids)
wall = time.perf_counter() - t0
R = N["_verify_half"]
print(f"wall {wall*1e3:.0f} ms tokens {tok} rounds {R}")
for k in sorted(T): print(f"  {k:16s} n={N[k]:5d} per-round {T[k]/R*1e3:7.3f} ms per-call {T[k]/N[k]*1e3:7.3f}")
