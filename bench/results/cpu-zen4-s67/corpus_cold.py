"""corpus_lookup per call with the caches cold, as inside the engine's rounds (a forward streams
hundreds of MB between two lookups): a 96 MB buffer is read between calls (its time not counted)."""
import time, sys, numpy as np, torch
from heterospec.datastore import corpus_for
from heterospec.datasets import load_prompts
from heterospec import Engine
torch.set_num_threads(1)
idx = corpus_for("heterospec/assets/smollm2-135m-instruct-eagle3")
# contexts: the corpus's own text at random places would be easy; use benchmark prompts' tokens
from transformers import AutoTokenizer
eng = Engine.from_pretrained(dtype=torch.float32)
tok = eng.tokenizer
ctxs = []
for s in ["mtbench", "alpaca", "gsm", "humaneval"]:
    for p in load_prompts(s, n=10):
        ids = tok.encode(p.text)
        for e in range(8, len(ids), 7):
            ctxs.append(ids[:e])
rng = np.random.default_rng(0)
ctxs = [ctxs[i] for i in rng.permutation(len(ctxs))[:400]]
flush = torch.ones(24 << 20)
def run(k, cold):
    ts = []
    for c in ctxs:
        if cold: flush.add_(1.0)
        t = time.perf_counter(); idx.lookup(c, k); ts.append(time.perf_counter() - t)
    return 1e6 * np.median(ts), 1e6 * np.mean(ts)
for rep in range(2):
    for k in (0, 8):
        for cold in (False, True):
            print(f"k={k} cold={cold}: median {run(k, cold)[0]:.1f} us, mean {run(k, cold)[1]:.1f} us")

import mmap
def huge_copy(t):
    nbytes = t.numel() * t.element_size()
    m = mmap.mmap(-1, nbytes + (2 << 20))
    m.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(m, dtype=torch.uint8)
    addr = buf.data_ptr(); off = (-addr) % (2 << 20)
    out = buf[off:off + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    out._keep = m
    return out
idx._tokens = huge_copy(idx._tokens); idx._order = huge_copy(idx._order); idx._keys = huge_copy(idx._keys)
with open("/proc/self/smaps_rollup") as f:
    print([l.strip() for l in f if "AnonHugePages" in l])
print("huge pages:")
for rep in range(2):
    for k in (0, 8):
        for cold in (False, True):
            print(f"k={k} cold={cold}: median {run(k, cold)[0]:.1f} us, mean {run(k, cold)[1]:.1f} us")
