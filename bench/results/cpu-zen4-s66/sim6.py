import json, sys, numpy as np
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/tmp/s66")
from heterospec.datastore import CorpusIndex
from heterospec.lookup import ContextIndex
from corpus import load_corpus
refs = json.load(open("/tmp/s66/refs.json"))
full, _ = load_corpus([f"/work/main/data/distill-v{i}" for i in range(2, 10)])
seps = np.flatnonzero(full == 0xFFFF)
for frac in (0.25, 0.5, 1.0):
    cut = seps[int(len(seps) * frac) - 1] + 1
    ci = CorpusIndex(full[:cut])
    tot = acc1 = acc2 = props = 0
    for r in refs:
        p, o = r["prompt"], r["output"]
        idx = ContextIndex(p)
        for t in range(len(o) - 1):
            own, on = idx.propose(8); idx.extend([o[t]])
            tot += 1
            if on >= 3: continue
            ch, g = ci.propose(p + o[:t], 8)
            if not ch: continue
            props += 1
            a = 0
            for x, y in zip(ch, o[t:t+8]):
                if x != y: break
                a += 1
            acc1 += a >= 1; acc2 += min(a, 2)
    print(f"corpus {cut} tokens: proposals {props/tot:.3f} of steps, first accepted {acc1/tot:.3f} of steps, E[min(acc,2)] per step {acc2/tot:.3f}")
