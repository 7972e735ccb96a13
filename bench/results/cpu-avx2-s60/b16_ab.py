import torch, time, functools, collections, sys
from heterospec import Engine
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
B = int(sys.argv[1])
eng = Engine.from_pretrained()
prompts = [p.text for s in ["mtbench", "alpaca"] for p in load_prompts(s, n=B // 2)][:B]
acc = collections.Counter(); cnt = collections.Counter(); cur = [None]
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[(cur[0], label)] += time.perf_counter() - t; cnt[(cur[0], label)] += 1; return r
    setattr(obj, name, g)
for n in ("_plain_step", "_decode_one", "_prefill", "_lookup_choice", "_emit"): wrap(eng, n, n)
wrap(eng.target, "forward", "forward")
for m in ("autoregressive", "heterospec"): eng.generate_batch(prompts, max_new_tokens=8, method=m)
tot = collections.Counter(); toks = collections.Counter()
for rep in range(4):
    for m in (("autoregressive", "heterospec") if rep % 2 == 0 else ("heterospec", "autoregressive")):
        cur[0] = m
        t = time.perf_counter(); rs = eng.generate_batch(prompts, max_new_tokens=96, method=m); tot[m] += time.perf_counter() - t
        toks[m] += sum(r.stats.new_tokens for r in rs)
for m in ("autoregressive", "heterospec"):
    other = tot[m] - acc[(m, "_decode_one")] - acc[(m, "_prefill")]
    print(m, "%.1f tok/s  total %.2f s  decode_one %.2f s (%d)  plain_step %.2f  forward %.2f  prefill %.2f  lookup %.3f  emit %.3f  rest %.3f" % (
        toks[m] / tot[m], tot[m], acc[(m, "_decode_one")], cnt[(m, "_decode_one")], acc[(m, "_plain_step")], acc[(m, "forward")], acc[(m, "_prefill")], acc[(m, "_lookup_choice")], acc[(m, "_emit")], other))
