import time, torch, heterospec.ops as O, sys
torch.set_num_threads(1); torch.manual_seed(0)
def q41(N,K):
    q = torch.randint(0,16,(N,K//32,32)).float(); q[...,0]=0; q[...,1]=15
    d = (torch.rand(N,K//32,1)*0.01).half().float(); m=(-torch.rand(N,K//32,1)*0.05).half().float()
    return (q*d+m).reshape(N,K)
N_,K_=1728,576
w=q41(N_,K_); fmt,c,s=O.stream_linear_pack_blocks(w)
raw=torch.ops.heterospec
rows=int(sys.argv[2]) if len(sys.argv)>2 else 1
x=torch.randn(rows,K_)
if sys.argv[1]=="bf16": x=x.bfloat16()
for _ in range(200): raw.stream_linear_blocks(x,c,s,None,N_)
best=1e9
for r in range(15):
    t0=time.perf_counter()
    for _ in range(200): raw.stream_linear_blocks(x,c,s,None,N_)
    best=min(best,(time.perf_counter()-t0)/200*1e6)
print(f"{sys.argv[1]} rows{rows} {best:.1f}us")
