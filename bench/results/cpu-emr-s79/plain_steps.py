"""Time of Engine._plain_step in autoregressive decoding, in heterospec and in heterospec without lookup
(interleaved per prompt; sets from argv, 4 prompts each x 128 tokens)."""
import sys, time, torch, heterospec, statistics, collections
from heterospec import datasets
import heterospec.engine as E
eng = heterospec.Engine.from_pretrained()
acc = collections.defaultdict(list)
orig_plain = E.Engine._plain_step
mode = ['']
def plain(self, st, params, gen, drafting):
    t = time.perf_counter(); out = orig_plain(self, st, params, gen, drafting); acc[(mode[0], drafting)].append(time.perf_counter() - t); return out
E.Engine._plain_step = plain
variants = {'ar': dict(method='autoregressive'), 'hs': dict(method='heterospec'), 'hs-nolookup': dict(method='heterospec', lookup=False)}
for name in sys.argv[1:]:
    for p in datasets.load_prompts(name, n=4):
        for m, kw in variants.items():
            mode[0] = m
            eng.generate(p.text, max_new_tokens=128, **kw)
for k, v in sorted(acc.items(), key=str):
    print(k, len(v), 'median %.3f mean %.3f ms' % (1e3*statistics.median(v), 1e3*statistics.mean(v)))
