"""heterospec's plain rounds right after a speculative round against the others (verify_s of the records),
and the rounds above 2x the median: SET's first N prompts x 128 tokens, float32, one process.
Usage: python plain_after_lookup.py SET N"""
import statistics, sys, torch, heterospec
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
e = heterospec.Engine.from_pretrained()
texts = [p.text for p in load_prompts(sys.argv[1], n=int(sys.argv[2]))]
e.generate(texts[0], max_new_tokens=32, method="heterospec")
after, other, slow, first = [], [], [], []
for t in texts:
    recs = e.generate(t, max_new_tokens=128, method="heterospec").stats.records
    for i, r in enumerate(recs):
        if not r.plain:
            continue
        (first if i < 3 else after if i > 0 and not recs[i - 1].plain else other).append(1e3 * r.verify_s)
allp = after + other + first
med = statistics.median(allp)
slow = [(round(v, 1)) for v in allp if v > 2 * med]
print(f"plain rounds {len(allp)}, median {med:.2f} ms, mean {statistics.mean(allp):.2f}")
def show(name, v):
    print(f"  {name}: n {len(v)}" + (f", mean {statistics.mean(v):.2f}, median {statistics.median(v):.2f}" if v else ""))
show("right after a speculative round", after)
show("the others (from the 4th round)", other)
show("a prompt's first 3 rounds", first)
print(f"  above 2x the median: {len(slow)}: {sorted(slow)}; their share of the plain time {sum(slow)/sum(allp):.3f}")
