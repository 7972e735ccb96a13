import torch, time, heterospec, statistics
from heterospec.datastore import corpus_for
from heterospec import defaults
import heterospec.engine as E
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
corpus = eng.lookup_corpus
buf = torch.randn(32 << 20)  # 128 MB
ctx = list(range(1000, 1100))
ctx = [int(t) for t in eng.tokenizer.encode("The quick brown fox jumps over the lazy dog and then it")]
def evict(): buf.mul_(1.0000001)
def t_(f, n=200):
    xs = []
    for _ in range(n):
        evict()
        t = time.perf_counter(); f(); xs.append(time.perf_counter() - t)
    return 1e6 * statistics.median(xs)
c8 = torch.tensor(ctx[-8:], dtype=torch.int64)
op = torch.ops.heterospec.corpus_lookup.default
tests = {
  "torch.zeros(4)": lambda: torch.zeros(4),
  "torch.tensor(list8)": lambda: torch.tensor(ctx[-8:], dtype=torch.int64),
  "op(prepared ctx)": lambda: op(corpus._tokens, corpus._order, c8, 8, corpus.MIN_MATCH, corpus.NMAX, corpus.SAMPLE, float(corpus.AGREE)),
  "op(empty ctx)": lambda: op(corpus._tokens, corpus._order, c8[:0], 8, corpus.MIN_MATCH, corpus.NMAX, corpus.SAMPLE, float(corpus.AGREE)),
  "corpus.lookup": lambda: corpus.lookup(ctx, 8),
  "corpus.propose": lambda: corpus.propose(ctx, 8),
  "dict get x8": lambda: [ {}.get(i) for i in range(8)],
  "nothing": lambda: None,
}
for k, f in tests.items():
    print(f"{k:22s} cold {t_(f):7.1f} us   warm {1e6*min(timeit(f) for timeit in [lambda g: (lambda t0: (g(), time.perf_counter()-t0)[1])(time.perf_counter())] for _ in range(50)):6.1f} us", flush=True)
