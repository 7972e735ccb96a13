"""(Needs the packed-key corpus_lookup that was tried and reverted in the sixty-seventh session.)
corpus_lookup cold (a 96 MB buffer read between calls), variants interleaved per context:
token-by-token narrowing vs the packed prefix keys; 4 KB pages vs 2 MB (THP) copies of the arrays."""
import time, sys, mmap, numpy as np, torch
from heterospec.datastore import corpus_for
from heterospec.datasets import load_prompts
from heterospec import Engine
torch.set_num_threads(1)
idx = corpus_for("heterospec/assets/smollm2-135m-instruct-eagle3")
tok = Engine.from_pretrained(dtype=torch.float32).tokenizer
ctxs = []
for s in ["mtbench", "alpaca", "gsm", "humaneval"]:
    for p in load_prompts(s, n=10):
        ids = tok.encode(p.text)
        ctxs += [torch.tensor(ids[max(0, e - 16):e]) for e in range(8, len(ids), 7)]
rng = np.random.default_rng(0)
ctxs = [ctxs[i] for i in rng.permutation(len(ctxs))[:600]]
def huge_copy(t):
    nbytes = t.numel() * t.element_size()
    m = mmap.mmap(-1, nbytes + (2 << 20)); m.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(m, dtype=torch.uint8); off = (-buf.data_ptr()) % (2 << 20)
    out = buf[off:off + nbytes].view(t.dtype).view(t.shape); out.copy_(t); out._keep = m
    return out
empty = torch.empty(0, dtype=torch.int64)
small = (idx._tokens, idx._order)
huge = (huge_copy(idx._tokens), huge_copy(idx._order), huge_copy(idx._keys))
variants = {"tokens": (*small, empty), "keys": (*small, idx._keys), "tokens+THP": (huge[0], huge[1], empty), "keys+THP": huge}
op = torch.ops.heterospec.corpus_lookup.default
flush = torch.ones(24 << 20)
ts = {v: [] for v in variants}
for c in ctxs:
    outs = []
    for v, args in variants.items():
        flush.add_(1.0)
        t = time.perf_counter(); r = op(*args, c, 8, 3, 16, 64, 0.5); ts[v].append(time.perf_counter() - t)
        outs.append((r[0].tolist(), r[1].tolist()))
    assert all(o == outs[0] for o in outs), (outs)
base = np.array(ts["tokens"])
for v, t in ts.items():
    t = np.array(t)
    print(f"{v:12s} median {1e6*np.median(t):6.1f} us  mean {1e6*t.mean():6.1f} us  median ratio to tokens {np.median(t/base):.2f}")
# the op's fixed cost cold: an empty context (no search), and another small op
e = torch.empty(0, dtype=torch.int64)
for name, fn in [("empty context", lambda: op(*variants["keys"], e, 8, 3, 16, 64, 0.5)),
                 ("torch.zeros(4)", lambda: torch.zeros(4)),
                 ("1-token context", lambda: op(*variants["keys"], ctxs[0][-1:], 8, 1, 16, 64, 0.5))]:
    for cold in (False, True):
        tt = []
        for _ in range(300):
            if cold: flush.add_(1.0)
            t = time.perf_counter(); fn(); tt.append(time.perf_counter() - t)
        print(f"{name:16s} cold={cold}: median {1e6*np.median(tt):.1f} us")
