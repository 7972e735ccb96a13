import json, sys, numpy as np
sys.path.insert(0, "/work/main")
from heterospec.datastore import corpus_for
from heterospec.lookup import ContextIndex, match_bucket
ci = corpus_for("/work/main/heterospec/assets/smollm2-135m-instruct-eagle3")
refs = json.load(open("/tmp/s66/refs.json"))
st = {}
for r in refs:
    p, o = r["prompt"], r["output"]
    idx = ContextIndex(p)
    for t in range(len(o) - 1):
        ctx = p + o[:t]; truth = o[t:t + 8]
        own, on = idx.propose(8); idx.extend([o[t]])
        ch, g = ci.propose(ctx, 8)
        def acc(c):
            a = 0
            for x, y in zip(c, truth):
                if x != y: break
                a += 1
            return a
        b = match_bucket(on) if on else -1
        st.setdefault(b, []).append((acc(own) if on else 0, acc(ch) if ch else 0, int(bool(ch))))
for b in sorted(st):
    a = np.array(st[b], float)
    print(b, len(a), "own P1", (a[:, 0] >= 1).mean().round(2), "own acc", a[:, 0].mean().round(2), "corpus has", a[:, 2].mean().round(2), "corpus P1", (a[:, 1] >= 1).mean().round(2), "corpus>own", (a[:, 1] > a[:, 0]).mean().round(2))
