"""Is the target's own confidence at the root (the distribution its bonus token came from)
predictive of the draft's first-token acceptance? eagle3 with a one-node chain; per round the
previous verify's top-1 probability at the accepted path's end, and this round's accept_len."""
import torch, collections, sys
from heterospec import Engine, SpecConfig
from heterospec.datasets import load_prompts
import heterospec.engine as E
torch.set_num_threads(2)
eng = Engine.from_pretrained(config=SpecConfig(top_k=1, depth=0, total_tokens=2))
sets = sys.argv[1:] or ["mtbench", "alpaca", "gsm"]
prompts = [p.text for s in sets for p in load_prompts(s, n=4)]
stash = {}
real_target = eng.target.__class__.__call__
orig_verify = E.Engine._verify
def verify(self, st, tree, *a, **k):
    logits_box = {}
    tgt = self.target
    orig_fwd = tgt.forward
    def fwd(*aa, **kk):
        out = orig_fwd(*aa, **kk); logits_box["l"] = out[0]; return out
    tgt.forward = fwd
    try:
        v = orig_verify(self, st, tree, *a, **k)
    finally:
        del tgt.forward
    l = logits_box["l"]
    end = v.accept_path.gather(1, v.accept_len[:, None])[:, 0]
    p = torch.softmax(l[0, end[0]].float(), -1).max().item()
    stash.setdefault("rounds", []).append((int(v.accept_len[0]), p))
    return v
E.Engine._verify = verify
pairs = []
for pr in prompts:
    stash["rounds"] = []
    eng.generate(pr, max_new_tokens=96, method="eagle3")
    r = stash["rounds"]
    pairs += [(r[i][1], r[i + 1][0]) for i in range(len(r) - 1)]
edges = [0.0, 0.3, 0.5, 0.7, 0.9, 0.97, 0.995, 1.01]
agg = collections.defaultdict(lambda: [0, 0])
for p, a in pairs:
    for lo, hi in zip(edges, edges[1:]):
        if lo <= p < hi: agg[(lo, hi)][0] += 1; agg[(lo, hi)][1] += a
print("rounds", len(pairs), "overall accept %.3f" % (sum(a for _, a in pairs) / len(pairs)))
for k in sorted(agg):
    n, a = agg[k]
    print("target top-1 prob [%.3f, %.3f): %4d rounds (%4.1f %%), draft first token accepted %.2f" % (k[0], k[1], n, 100 * n / len(pairs), a / n))
