import torch, time
from torch.utils.cpp_extension import load
torch.set_num_threads(2)
ext = load("rowstream", ["rowstream.cpp"], extra_cflags=["-O3","-fopenmp"], extra_ldflags=["-fopenmp"])
def t(f, n=200):
    for _ in range(10): f()
    s=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-s)/n*1e6
W=torch.randn(576,576)
for M in (1,2,4,8,16):
    x=torch.randn(M,576)
    print(M, round(t(lambda: ext.rowstream(x,W)),1), round(t(lambda: torch.nn.functional.linear(x,W)),1))
torch.set_num_threads(1)
for M in (1,8):
    x=torch.randn(M,576)
    print('1thr',M, round(t(lambda: ext.rowstream(x,W)),1), round(t(lambda: torch.nn.functional.linear(x,W)),1))
