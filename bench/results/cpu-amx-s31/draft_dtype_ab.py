import time, torch, sys, collections, statistics
from heterospec import Engine
from heterospec.bench import load_prompt_sets
engs = {"bf16": Engine.from_pretrained(dtype=torch.float32, draft_dtype=torch.bfloat16),
        "f32": Engine.from_pretrained(dtype=torch.float32, draft_dtype=torch.float32)}
sets = load_prompt_sets(["mtbench", "humaneval", "gsm", "alpaca", "cnndm"], 3, 1)
ps = [q.text for qs in sets.values() for q in qs]
methods = ["autoregressive", "eagle3", "heterospec"]
for e in engs.values():
    for m in methods: e.generate(ps[0], max_new_tokens=8, method=m)
tt = collections.defaultdict(float); nt = collections.defaultdict(int); tau = collections.defaultdict(list)
for i, p in enumerate(ps):
    order = list(engs.items()) if i % 2 == 0 else list(engs.items())[::-1]
    for name, e in order:
        for m in methods:
            if m == "autoregressive" and name == "f32": continue
            t = time.perf_counter(); r = e.generate(p, max_new_tokens=96, method=m); dt = time.perf_counter() - t
            tt[(name, m)] += dt; nt[(name, m)] += r.stats.new_tokens
            tau[(name, m)].append(r.stats.new_tokens / max(1, r.stats.rounds))
    print(i, {f"{k[0]}/{k[1]}": round(nt[k] / tt[k], 1) for k in tt}, flush=True)
ar = nt[("bf16", "autoregressive")] / tt[("bf16", "autoregressive")]
for k in tt:
    print(k, "tok/s %.1f  vs AR %.3f  tokens/round %.2f" % (nt[k] / tt[k], nt[k] / tt[k] / ar, statistics.mean(tau[k])))
