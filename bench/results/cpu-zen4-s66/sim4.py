import json, sys, numpy as np
sys.path.insert(0, "/work/main")
from heterospec.datastore import corpus_for, SEP
from heterospec.lookup import ContextIndex
ci = corpus_for("/work/main/heterospec/assets/smollm2-135m-instruct-eagle3")
refs = json.load(open("/tmp/s66/refs.json"))
rows = []
for r in refs:
    p, o = r["prompt"], r["output"]
    idx = ContextIndex(p)
    for t in range(len(o) - 1):
        ctx = p + o[:t]; tr = o[t]
        own, on = idx.propose(8); idx.extend([o[t]])
        if on >= 4: continue
        n, lo, hi = ci.match(ctx)
        if n < 3: continue
        occ = ci._sa[lo:hi].astype(np.int64)
        nxt = ci._fwd[ci.N - occ]
        nxt = nxt[nxt != SEP]
        if len(nxt) == 0: continue
        v, c = np.unique(nxt, return_counts=True)
        top = v[c.argmax()]; agree = c.max() / len(nxt); sup = c.max()
        rows.append((n, agree, sup, int(top == tr)))
a = np.array(rows, float)
print("all", len(a), a[:, 3].mean())
for name, col, edges in [("n", 0, [3, 4, 6, 9, 17]), ("agree", 1, [0, .5, .7, .85, .95, 1.01]), ("support", 2, [1, 2, 3, 5, 10, 30, 1e9])]:
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (a[:, col] >= lo) & (a[:, col] < hi)
        print(f"  {name} [{lo},{hi}): {m.mean():.2f} P1 {a[m,3].mean():.2f}")
print("agree x support")
for alo, ahi in [(0, .7), (.7, .95), (.95, 1.01)]:
    for slo, shi in [(1, 2), (2, 5), (5, 1e9)]:
        m = (a[:, 1] >= alo) & (a[:, 1] < ahi) & (a[:, 2] >= slo) & (a[:, 2] < shi)
        print(f"  agree [{alo},{ahi}) sup [{slo},{shi}): {m.mean():.2f} P1 {a[m,3].mean():.2f}")
