import time, torch, heterospec, sys, functools
from heterospec.bench import load_prompt_sets
from heterospec import engine as E
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
fwd = [0.0]; ctx = {"kind": None}
acc = {}
def add(k, v): a = acc.setdefault(k, [0.0, 0]); a[0] += v; a[1] += 1
TF = type(eng.target).forward
def tf(*a, **k):
    t = time.perf_counter(); r = TF(*a, **k); dt = time.perf_counter() - t
    if ctx["kind"]: add(ctx["kind"] + ".forward", dt)
    return r
type(eng.target).forward = tf
def wrapk(name, kind):
    f = getattr(E.Engine, name)
    @functools.wraps(f)
    def g(*a, **k):
        ctx["kind"] = kind; t = time.perf_counter()
        try: return f(*a, **k)
        finally: add(kind + "." + name, time.perf_counter() - t); ctx["kind"] = None
    setattr(E.Engine, name, g)
for n in ["_lookup_tree", "_verify", "_commit"]: wrapk(n, "lookup")
wrapk("_decode_one", "plain")
sets = load_prompt_sets(["mtbench", "alpaca", "humaneval"], int(sys.argv[1]) if len(sys.argv) > 1 else 6)
ps = [p.text for s in sets.values() for p in s]
eng.generate(ps[0], max_new_tokens=16)
acc.clear()
for p in ps: eng.generate(p, max_new_tokens=96)
for k, (s, n) in sorted(acc.items()): print(f"{k:24s} {1e3*s/n:7.3f} ms x {n}")
lk = acc.get("lookup._verify"); 
if lk:
    n = lk[1]; host = (acc["lookup._lookup_tree"][0] + lk[0] + acc["lookup._commit"][0] - acc["lookup.forward"][0]) / n
    print(f"lookup round: forward {1e3*acc['lookup.forward'][0]/n:.3f} ms, host {1e3*host:.3f} ms")
pl = acc["plain._decode_one"]; print(f"plain step: forward {1e3*acc['plain.forward'][0]/pl[1]:.3f} ms, host {1e3*(pl[0]-acc['plain.forward'][0])/pl[1]:.3f} ms")
