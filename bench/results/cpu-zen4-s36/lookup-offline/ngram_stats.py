import json, sys
from collections import defaultdict
data = json.load(open(sys.argv[1])); NMAX = int(sys.argv[2])
def propose(ctx, k):
    L = len(ctx)
    for n in range(NMAX, 0, -1):
        if L < n + 1: continue
        pat = ctx[L - n:]
        for s in range(L - n - 1, -1, -1):
            if ctx[s:s + n] == pat:
                return ctx[s + n:s + n + k], n
    return [], 0
K = 6
acc = defaultdict(lambda: [[0, 0] for _ in range(K)])   # (set?, n) -> per position [tried, ok]
for r in data:
    ctx = list(r["prompt"]); resp = r["resp"]; i = 0
    while i < len(resp):
        prop, n = propose(ctx, K)
        a = 0
        while a < len(prop) and i + a < len(resp) and prop[a] == resp[i + a]: a += 1
        for j in range(min(a + 1, len(prop))):
            if i + j >= len(resp): break
            acc[n][j][0] += 1; acc[n][j][1] += j < a
        step = min(a, len(resp) - i - 1) + 1 if a else 1
        ctx += resp[i:i + step]; i += step
for n in sorted(acc):
    print(n, " ".join(f"{ok/t:.2f}({t})" if t else "-" for t, ok in acc[n]))
