import torch, time, statistics, heterospec, sys
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
corpus = eng.lookup_corpus
ctx = [int(t) for t in eng.tokenizer.encode("The quick brown fox jumps over the lazy dog and then it")]
buf = torch.randn(32 << 20)
small = torch.randn(1 << 16)
import numpy as np
nbuf = np.ones(32 << 20, np.float32)
def ev_mul2(): buf.mul_(1.0000001)
def ev_mul1():
    torch.set_num_threads(1); buf.mul_(1.0000001); torch.set_num_threads(2)
def ev_np(): np.multiply(nbuf, 1.0000001, out=nbuf)
def ev_sleep(): time.sleep(0.007)
def ev_small2(): small.mul_(1.0000001)
def ev_fwd():
    eng.target  # placeholder
def t_(f, ev, n=150):
    xs = []
    for _ in range(n):
        ev(); t = time.perf_counter(); f(); xs.append(time.perf_counter() - t)
    return 1e6 * statistics.median(xs)
fs = {"torch.zeros(4)": lambda: torch.zeros(4), "corpus.lookup": lambda: corpus.lookup(ctx, 8),
      "dict get x8": lambda: [{}.get(i) for i in range(8)]}
for evn, ev in [("mul 2 threads", ev_mul2), ("mul 1 thread", ev_mul1), ("numpy 1 thread", ev_np), ("sleep 7ms", ev_sleep), ("small mul 2 thr", ev_small2)]:
    print(evn, " | ".join(f"{k} {t_(f, ev):6.1f}" for k, f in fs.items()), flush=True)
