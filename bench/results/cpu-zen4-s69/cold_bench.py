import torch, time
from heterospec import ops
from heterospec.models import linear as L
torch.manual_seed(0)
N,K=1536,576
copies=int(__import__('sys').argv[1]) if len(__import__('sys').argv)>1 else 96
fmts={}
for fmt in ['f32','q4_1','q8_0','f16']:
    if fmt=='f32':
        fmts[fmt]=[ops.stream_linear_pack(torch.randn(N,K)) for _ in range(copies)]
    else:
        fmts[fmt]=[L._random_packed(N,K,fmt) for _ in range(copies)]
def call(fmt,x,p):
    if fmt in ('f32','f16'): return ops.stream_linear(x,p,None,N)
    return ops.stream_linear_blocks(x,p[0],p[1],None,N)
for M in [1,2,3,4,6,8]:
    x=torch.randn(M,K)
    res=[]
    for fmt,ps in fmts.items():
        for p in ps[:4]: call(fmt,x,p)
        best=1e9
        for r in range(5):
            t=time.perf_counter()
            for p in ps: call(fmt,x,p)
            best=min(best,(time.perf_counter()-t)/len(ps))
        nbytes=L._nbytes(ps[0])
        res.append(f"{fmt} {best*1e6:6.1f}us {nbytes/best/1e9:5.1f}GB/s")
    print(M, ' | '.join(res), flush=True)
