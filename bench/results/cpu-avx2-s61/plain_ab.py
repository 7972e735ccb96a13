import torch, time, functools, collections
from heterospec import Engine
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
eng = Engine.from_pretrained()
prompts = [p.text for s in ["mtbench", "alpaca"] for p in load_prompts(s, n=3)]
acc = collections.Counter(); cnt = collections.Counter()
cur = [None]
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[(cur[0], label)] += time.perf_counter() - t; cnt[(cur[0], label)] += 1; return r
    setattr(obj, name, g)
wrap(eng, "_plain_step", "plain_step"); wrap(eng, "_decode_one", "decode_one"); wrap(eng, "_prefill", "prefill")
for m in ["autoregressive", "heterospec"]:
    eng.generate(prompts[0], max_new_tokens=8, method=m)
tot = collections.Counter(); toks = collections.Counter()
for rep in range(3):
    for i, p in enumerate(prompts):
        order = ["autoregressive", "heterospec"] if (i + rep) % 2 == 0 else ["heterospec", "autoregressive"]
        for m in order:
            cur[0] = m
            r = eng.generate(p, max_new_tokens=96, method=m)
            tot[m] += r.stats.total_s; toks[m] += r.stats.new_tokens
for m in ["autoregressive", "heterospec"]:
    print(m, "%.1f tok/s" % (toks[m] / tot[m]), "  ".join("%s %.3f ms x%d" % (l, acc[(m, l)] / cnt[(m, l)] * 1e3, cnt[(m, l)]) for l in ("plain_step", "decode_one", "prefill")))
print("ratio %.3f" % ((toks["heterospec"] / tot["heterospec"]) / (toks["autoregressive"] / tot["autoregressive"])))
