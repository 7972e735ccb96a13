"""Probe (twenty-first session): a row-streaming AVX-512 linear (rowstream.cpp) against F.linear (MKL)
and the oneDNN reordered path TunedLinear uses, cache-cold, 2 threads. Run from this directory:
`python run.py` (prints per shape: M<rows>:stock/packed/rowstream us). `python hot.py`: cache-hot, 1-2 threads."""
import os, sys, time
import torch
from torch.utils.cpp_extension import load
torch.set_num_threads(2)
ext = load("rowstream", ["rowstream.cpp"], extra_cflags=["-O3","-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../../.."))
from heterospec.models import linear as L
def cold(fn_of_w, Ws, n=30):
    for W in Ws[:3]: fn_of_w(W)
    t = time.perf_counter()
    for i in range(n):
        fn_of_w(Ws[i % len(Ws)])
    return (time.perf_counter() - t) / n * 1e6
for K, N in [(576, 576), (576, 1536), (1536, 576), (576, 49152)]:
    copies = max(2, int(2 * 100e6 / (K * N * 4)))
    copies = min(copies, 64)
    Ws = [torch.randn(N, K) for _ in range(copies)]
    Ps = [L._reorder(W) for W in Ws]
    row = []
    for M in (1, 2, 4, 8, 12, 16):
        x = torch.randn(M, K)
        ref = torch.nn.functional.linear(x, Ws[0]); got = ext.rowstream(x, Ws[0])
        err = (ref - got).abs().max().item()
        a = cold(lambda W: torch.nn.functional.linear(x, W), Ws)
        idx = iter(range(10**9))
        b = cold(lambda P: L._packed_forward(x, P, None), Ps)
        c = cold(lambda W: ext.rowstream(x, W), Ws)
        row.append(f"M{M}:{a:.0f}/{b:.0f}/{c:.0f}(e{err:.0e})")
    print((K, N), copies, ' '.join(row), flush=True)
