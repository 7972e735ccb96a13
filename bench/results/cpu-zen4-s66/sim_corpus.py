import glob, time, numpy as np
from safetensors.numpy import load_file
SEP = 0xFFFF
def load_corpus(dirs, head=3, greedy_only=True):
    parts = []; ntok = 0
    for d in dirs:
        for f in sorted(glob.glob(d + "/shard_*.safetensors")):
            s = load_file(f)
            so, pl, tk, sm = s["seq_offsets"], s["prompt_lens"], s["tokens"], s["sampled"]
            for i in range(len(pl)):
                if greedy_only and sm[i]: continue
                seq = tk[so[i]:so[i+1]]
                a = max(int(pl[i]) - head, 0)
                parts.append(seq[a:]); parts.append(np.array([SEP], np.uint16)); ntok += len(seq) - int(pl[i])
    return np.concatenate(parts).astype(np.int64), ntok

class Corpus:
    W = 4  # words of 4 tokens: matches up to 16 tokens
    def __init__(self, toks):
        R = toks[::-1].copy()
        N = len(R)
        pad = np.concatenate([R, np.full(4 * self.W, SEP, np.int64)])
        words = []
        for w in range(self.W):
            k = np.zeros(N, np.uint64)
            for j in range(4):
                k = (k << np.uint64(16)) | pad[w * 4 + j: w * 4 + j + N].astype(np.uint64)
            words.append(k)
        order = np.lexsort(words[::-1])
        self.words = [k[order] for k in words]
        self.sa = order
        self.fwd = toks; self.N = N; self.fwdpad = np.concatenate([toks, np.full(16, SEP, np.int64)])
    def match(self, ctx, nmax=16):
        """longest n with occurrences of ctx[-n:]; returns (n, lo, hi)"""
        lo, hi = 0, self.N; best = (0, 0, 0)
        rq = ctx[::-1][:nmax]
        for n in range(1, len(rq) + 1):
            w, j = (n - 1) // 4, (n - 1) % 4
            base = 0
            for t in range(j + 1):
                base = (base << 16) | int(rq[w * 4 + t])
            sh = 16 * (3 - j)
            klo = np.uint64(base << sh); khi = np.uint64(((base + 1) << sh) - 1)
            arr = self.words[w]
            a = lo + int(np.searchsorted(arr[lo:hi], klo, "left"))
            b = lo + int(np.searchsorted(arr[lo:hi], khi, "right"))
            if a >= b: break
            lo, hi = a, b; best = (n, lo, hi)
        return best
    def propose(self, ctx, k=8, cap=64):
        n, lo, hi = self.match(ctx)
        if n == 0: return [], 0, 0, []
        idx = self.sa[lo:hi]
        if len(idx) > cap: idx = idx[np.linspace(0, len(idx) - 1, cap).astype(np.int64)]
        start = self.N - idx  # forward index of the continuation
        pad = self.fwdpad
        M = pad[start[:, None] + np.arange(k)[None, :]]
        chain, conf = [], []
        rows = np.ones(len(M), bool)
        for j in range(k):
            col = M[rows, j]
            col = col[col != SEP]
            if len(col) == 0: break
            v, c = np.unique(col, return_counts=True)
            t = int(v[c.argmax()]); conf.append(c.max() / rows.sum())
            chain.append(t); rows &= (M[:, j] == t)
        return chain, n, hi - lo, conf
