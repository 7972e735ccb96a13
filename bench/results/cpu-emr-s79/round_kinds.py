"""Per kind of round (tree, lookup, plain) of heterospec, and autoregressive per token: rounds, tokens,
draft and verify time (sets from argv, 4 prompts each x 128 tokens, interleaved per prompt)."""
import sys, torch, heterospec, collections
from heterospec import datasets
eng = heterospec.Engine.from_pretrained()
agg = collections.defaultdict(lambda: [0, 0, 0.0, 0.0, 0])
for name in sys.argv[1:]:
    for p in datasets.load_prompts(name, n=4):
        for m in ('autoregressive', 'heterospec'):
            r = eng.generate(p.text, max_new_tokens=128, method=m)
            if m == 'autoregressive':
                a = agg['AR']; a[0] += 1; a[1] += r.stats.new_tokens; a[2] += r.stats.total_s - r.stats.prefill_s
                continue
            for rec in r.stats.records:
                k = 'plain' if rec.plain else 'lookup' if rec.lookup or rec.history or rec.corpus else 'tree'
                a = agg[k]; a[0] += 1; a[1] += rec.accept_len + 1; a[2] += rec.draft_s; a[3] += rec.verify_s; a[4] += rec.verified
            a = agg['HS']; a[0] += 1; a[1] += r.stats.new_tokens; a[2] += r.stats.total_s - r.stats.prefill_s
for k, (n, tok, d, v, ver) in agg.items():
    print(f"{k:7s} n={n:5d} tok={tok:6d} draft={d:7.2f}s verify={v:7.2f}s  per-round d={1e3*d/n:6.2f} v={1e3*v/n:6.2f} ms  tok/round={tok/n:.2f} verified/round={ver/max(n,1):.2f} ms/token={1e3*(d+v)/tok:.2f}")
