"""The quick cost model's verify curve (fastest of its repeats) against the verify of the engine's own rounds,
in one process: eagle3 rounds (8 nodes) and heterospec's lookup rounds, SET x N prompts x 128 tokens."""
import sys, statistics as st, numpy as np, torch, heterospec
from heterospec import costmodel
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
s, n = sys.argv[1], int(sys.argv[2])
e = heterospec.Engine.from_pretrained()
texts = [p.text for p in load_prompts(s, n=n)]
e.generate(texts[0], max_new_tokens=16, method="eagle3")
cms = [costmodel.measure(e, quick=True, progress=False) for _ in range(2)]
for cm in cms:
    print("quick model: plain %.2f verify %s" % (cm.plain[0], [round(x, 1) for x in cm.verify[0]]), "nodes", cm.nodes)
nodes, ver = cms[0].nodes, cms[0].verify[0]
ev, lk = [], {}
for t in texts:
    r = e.generate(t, max_new_tokens=128, method="eagle3")
    ev += [1e3 * x.verify_s for x in r.stats.records]
    r = e.generate(t, max_new_tokens=128, method="heterospec")
    for x in r.stats.records:
        if x.lookup:
            lk.setdefault(int(x.verified), []).append(1e3 * (x.verify_s + x.draft_s))
    ar = e.generate(t, max_new_tokens=128, method="autoregressive")
    print("AR ms/step %.2f" % (1e3 * ar.stats.verify_s / ar.stats.target_calls))
print("eagle3 rounds: verify median %.2f (n=%d), model verify(8) %.2f, ratio %.2f" % (st.median(ev), len(ev), np.interp(8, nodes, ver), st.median(ev) / np.interp(8, nodes, ver)))
for k, v in sorted(lk.items()):
    print("lookup rounds of %d nodes: n=%d median %.2f model %.2f ratio %.2f" % (k, len(v), st.median(v), np.interp(k, nodes, ver), st.median(v) / np.interp(k, nodes, ver)))
