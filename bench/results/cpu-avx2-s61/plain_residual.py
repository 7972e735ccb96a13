import torch, time, functools, collections
from heterospec import Engine
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
eng = Engine.from_pretrained()
prompts = [p.text for s in ["mtbench", "alpaca"] for p in load_prompts(s, n=3)]
acc = collections.Counter(); cnt = collections.Counter(); cur = [None]
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[(cur[0], label)] += time.perf_counter() - t; cnt[(cur[0], label)] += 1; return r
    setattr(obj, name, g)
for n in ("_decode_one", "_prefill", "_verify", "_commit", "_lookup_proposals"):
    if hasattr(eng, n): wrap(eng, n, n)
for m in ["autoregressive", "heterospec"]:
    eng.generate(prompts[0], max_new_tokens=8, method=m)
acc.clear(); cnt.clear()
tot = collections.Counter(); toks = collections.Counter(); calls = collections.Counter()
for rep in range(3):
    for i, p in enumerate(prompts):
        for m in (["autoregressive", "heterospec"] if (i + rep) % 2 == 0 else ["heterospec", "autoregressive"]):
            cur[0] = m
            r = eng.generate(p, max_new_tokens=96, method=m)
            tot[m] += r.stats.total_s; toks[m] += r.stats.new_tokens; calls[m] += r.stats.target_calls
for m in ["autoregressive", "heterospec"]:
    parts = {l: acc[(m, l)] for (mm, l) in list(acc) if mm == m}
    print(m, "tok/s %.1f, calls %d, total %.3f s" % (toks[m] / tot[m], calls[m], tot[m]))
    for l, v in parts.items(): print("   %-18s %.3f s  (%d calls, %.3f ms each)" % (l, v, cnt[(m, l)], v / cnt[(m, l)] * 1e3))
    inner = parts.get("_decode_one", 0) + parts.get("_prefill", 0) + parts.get("_verify", 0) + parts.get("_commit", 0) + parts.get("_lookup_proposals", 0)
    print("   residual %.3f s = %.3f ms a target call" % (tot[m] - inner, (tot[m] - inner) / calls[m] * 1e3))
