import time, torch, heterospec, sys, functools, collections
from heterospec.bench import load_prompt_sets
from heterospec import engine as E
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
stats = collections.defaultdict(list); ctx = {"kind": "other"}
TF = type(eng.target).forward
def tf(self, tokens, *a, **k):
    t = time.perf_counter(); r = TF(self, tokens, *a, **k); dt = time.perf_counter() - t
    stats[(ctx["kind"], tokens.shape[1], bool(k.get("return_features")))].append(dt)
    return r
type(eng.target).forward = tf
for name, kind in [("_verify", "lookup"), ("_decode_one", "plain")]:
    f = getattr(E.Engine, name)
    def mk(f, kind):
        @functools.wraps(f)
        def g(*a, **k):
            ctx["kind"] = kind
            try: return f(*a, **k)
            finally: ctx["kind"] = "other"
        return g
    setattr(E.Engine, name, mk(f, kind))
sets = load_prompt_sets(["mtbench", "alpaca", "humaneval"], 6)
ps = [p.text for s in sets.values() for p in s]
eng.generate(ps[0], max_new_tokens=16); stats.clear()
for p in ps: eng.generate(p, max_new_tokens=96)
import statistics
for k in sorted(stats, key=str):
    v = stats[k]; print(k, len(v), f"median {1e3*statistics.median(v):.2f} ms  mean {1e3*sum(v)/len(v):.2f}")
print(eng.cost_model.target_ms(1), eng.cost_model.target_ms(2), eng.cost_model.target_ms(3), eng.cost_model.verify_ms(1, 1), eng.cost_model.verify_ms(1, 2))
