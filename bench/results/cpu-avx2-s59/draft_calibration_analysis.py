import pickle, numpy as np, math, sys
from collections import defaultdict
def load(w):
    d = pickle.load(open(f"/tmp/s59/diag_{w}.pkl", "rb")); return d
k = 4
def layer(c): return 1 if c < k else 2 + (c - k) // (k * k)
def calib_table(rec, nb=10):
    # per layer, bins of local prob: [n, reached | parent reached]
    t = defaultdict(lambda: np.zeros((nb, 2)))
    for _, rows in rec:
        for c, p, s, l, pr, r in rows:
            if not pr: continue
            b = min(nb - 1, int(math.exp(l) * nb))
            t[layer(c)][b] += (1, r)
    return t
def show(t, nb=10):
    for L in sorted(t):
        a = t[L]
        print("layer", L, " ".join("%.1f:%d/%.2f" % ((i + .5) / nb, a[i, 0], a[i, 1] / max(a[i, 0], 1)) for i in range(nb) if a[i, 0] >= 5))
def fmap(t, nb=10, prior=5):
    # calibrated acceptance per (layer, bin), shrunk to the bin's mid prob
    f = {}
    for L, a in t.items():
        f[L] = [(a[i, 1] + prior * (i + .5) / nb) / (a[i, 0] + prior) for i in range(nb)]
    return f
def evaluate(rec, f=None, Ns=(2, 3, 4, 5, 6, 8, 10, 12, 16), nb=10):
    tot = {N: 0.0 for N in Ns}
    for _, rows in rec:
        par = {c: p for c, p, *_ in rows}
        if f is None:
            score = {c: s for c, p, s, l, pr, r in rows}
        else:
            score = {}
            for c, p, s, l, pr, r in rows:  # rows in candidate order: parents first
                b = min(nb - 1, int(math.exp(l) * nb))
                g = math.log(max(f[layer(c)][b], 1e-6))
                score[c] = g + (0 if p < 0 else score[p])
        reached = {c: r for c, p, s, l, pr, r in rows}
        order = sorted(score, key=lambda c: -score[c])
        for N in Ns:
            chosen = set(); 
            for c in order:
                if len(chosen) >= N - 1: break
                # ancestor closed
                a = par[c]; ok = True
                while a >= 0:
                    if a not in chosen: ok = False; break
                    a = par[a]
                if ok: chosen.add(c)
            tot[N] += sum(reached[c] for c in chosen)
    return {N: tot[N] / len(rec) for N in Ns}
if __name__ == "__main__":
    cal = load("calib")["rec"]
    t = calib_table(cal); print("calibration prompts"); show(t)
    print("raw  ", {N: round(v, 3) for N, v in evaluate(cal).items()})
    # 2-fold on calib
    a, b = cal[: len(cal) // 2], cal[len(cal) // 2:]
    print("cv cal", {N: round(v, 3) for N, v in evaluate(b, fmap(calib_table(a))).items()}, {N: round(v, 3) for N, v in evaluate(b).items()})
    if len(sys.argv) > 1:
        be = load("bench")["rec"]
        print("bench calibration"); show(calib_table(be))
        print("bench raw ", {N: round(v, 3) for N, v in evaluate(be).items()})
        print("bench calf", {N: round(v, 3) for N, v in evaluate(be, fmap(t)).items()})
