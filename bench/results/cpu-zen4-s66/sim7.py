import json, sys, numpy as np
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/tmp/s66")
from heterospec.datastore import CorpusIndex
from heterospec.lookup import ContextIndex
from heterospec.train.corpus import corpus_tokens
refs = json.load(open("/tmp/s66/refs.json"))
dirs = [f"/work/main/data/distill-v{i}" for i in range(2, 10)]
for greedy_only in (True, False):
    toks, info = corpus_tokens(dirs, greedy_only=greedy_only)
    ci = CorpusIndex(toks)
    tot = acc1 = acc2 = props = 0; g5 = g5a = 0
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
            if g >= 4: g5 += 1; g5a += a >= 1
    print(f"greedy_only={greedy_only} {len(toks)} tokens: proposals {props/tot:.3f}, first accepted {acc1/tot:.3f} of steps, E[min(acc,2)] {acc2/tot:.3f}; grade>=4 {g5/tot:.3f} of steps, P1 {g5a/max(g5,1):.2f}")
