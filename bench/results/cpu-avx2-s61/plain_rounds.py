import torch, collections
from heterospec import Engine
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
eng = Engine.from_pretrained()
prompts = [p.text for s in ["mtbench", "alpaca"] for p in load_prompts(s, n=3)]
eng.generate(prompts[0], max_new_tokens=8, method="heterospec")
for rep in range(2):
    agg = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
    tot_s = 0; toks = 0
    for p in prompts:
        r = eng.generate(p, max_new_tokens=96, method="heterospec")
        tot_s += r.stats.total_s; toks += r.stats.new_tokens
        for rr in r.stats.records:
            kind = "plain" if rr.plain else ("lookup" if rr.lookup else "draft")
            a = agg[(kind, rr.verified)]
            a[0] += 1; a[1] += rr.accept_len + 1; a[2] += rr.draft_s; a[3] += rr.verify_s
    print("rep", rep, "tok/s %.1f" % (toks / tot_s))
    for k in sorted(agg):
        n, t, d, v = agg[k]
        print("  %-6s verified %d: %4d rounds, %.2f tokens/round, draft %.2f ms, verify %.2f ms, ms/token %.2f" % (k[0], k[1], n, t / n, d / n * 1e3, v / n * 1e3, (d + v) / t * 1e3))
