"""Where a plain round's time goes, heterospec against autoregressive (one process, float32, greedy):
the engine's methods wrapped with wall-clock accumulators (no profiler), SET's first N prompts x 128
tokens, the two methods per prompt in turn. Prints ms per target call of: the target step
(_plain_step), the rest of _decode_one (the draft's pending extend), the lookup gate (_lookup_choice),
the policy's round plan, token emission, and what is left of the decode loop.
Usage: python plain_round_split.py SET N [nolookup]   (nolookup: heterospec with lookup=False)"""
import json, sys, time, torch, heterospec
from heterospec import engine as E, policy as P
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
acc = {}
def wrap(cls, name, key):
    f = getattr(cls, name)
    def g(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0
    setattr(cls, name, g)
wrap(E.Engine, "_plain_step", "plain_step")
wrap(E.Engine, "_decode_one", "decode_one")
wrap(E.Engine, "_lookup_choice", "lookup_choice")
wrap(E.Engine, "_emit", "emit")
wrap(E.Engine, "_prefill", "prefill")
wrap(P.FittedPolicy, "round_plan", "round_plan")
s, n = sys.argv[1], int(sys.argv[2])
kw = {"heterospec": {"lookup": False}} if sys.argv[3:] == ["nolookup"] else {}
e = heterospec.Engine.from_pretrained()
texts = [p.text for p in load_prompts(s, n=n)]
for m in ("autoregressive", "heterospec"):
    e.generate(texts[0], max_new_tokens=32, method=m)
res = {m: {"calls": 0, "wall": 0.0, "parts": {}} for m in ("autoregressive", "heterospec")}
for i, t in enumerate(texts):
    for m in (("autoregressive", "heterospec") if i % 2 == 0 else ("heterospec", "autoregressive")):
        acc.clear()
        t0 = time.perf_counter()
        r = e.generate(t, max_new_tokens=128, method=m, **kw.get(m, {}))
        wall = time.perf_counter() - t0
        res[m]["calls"] += r.stats.target_calls
        res[m]["wall"] += wall - acc.get("prefill", 0.0)
        for k, v in acc.items():
            res[m]["parts"][k] = res[m]["parts"].get(k, 0.0) + v
out = {}
for m, r in res.items():
    p, c = r["parts"], r["calls"]
    d = {"calls": c, "decode loop ms/call": 1e3 * r["wall"] / c,
         "target step": 1e3 * p.get("plain_step", 0) / c,
         "rest of _decode_one": 1e3 * (p.get("decode_one", 0) - p.get("plain_step", 0)) / c,
         "lookup gate": 1e3 * p.get("lookup_choice", 0) / c, "round_plan": 1e3 * p.get("round_plan", 0) / c,
         "emit": 1e3 * p.get("emit", 0) / c}
    d["left"] = d["decode loop ms/call"] - d["target step"] - d["rest of _decode_one"] - d["lookup gate"] - d["round_plan"] - d["emit"]
    if m == "heterospec":
        d["note"] = "target step, rest of _decode_one: plain rounds only (speculative rounds: in left)"
    out[m] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items()}
print(json.dumps(out, indent=1))
