"""Simulate prompt/context lookup drafting on AR greedy outputs: tau per set for chain length k."""
import json, sys
from collections import defaultdict
data = json.load(open(sys.argv[1]))
def propose(ctx, k, nmax=4, nmin=1):
    L = len(ctx)
    for n in range(nmax, nmin - 1, -1):
        if L < n + 1: continue
        pat = ctx[L - n:]
        # latest earlier occurrence
        for s in range(L - n - 1, -1, -1):
            if ctx[s:s + n] == pat:
                return ctx[s + n:s + n + k], n
    return [], 0
for nmin in (1, 2, 3):
  print(f"--- min n-gram {nmin}")
  for k in (1, 2, 3, 4, 6):
    per = defaultdict(lambda: [0, 0, 0, 0])  # steps, tokens, steps with proposal, accepted
    for r in data:
        ctx = list(r["prompt"]); resp = r["resp"]; i = 0
        while i < len(resp):
            prop, n = propose(ctx, k, nmin=nmin)
            a = 0
            while a < len(prop) and i + a < len(resp) and prop[a] == resp[i + a]: a += 1
            acc = min(a, len(resp) - i - 1) if i + a >= len(resp) else a
            step = acc + 1
            ctx += resp[i:i + step]; i += step
            p = per[r["set"]]; p[0] += 1; p[1] += step; p[2] += bool(prop); p[3] += acc
    row = " ".join(f"{s}: tau {p[1]/p[0]:.3f} cov {p[2]/p[0]:.2f}" for s, p in per.items())
    print(f"k={k} {row}")
