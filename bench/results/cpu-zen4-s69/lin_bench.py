import torch, time, heterospec
from heterospec import ops
torch.manual_seed(0)
K,N=576,1536
w=torch.randn(N,K)
p=ops.stream_linear_pack(w)
for M in [1,2,3,4,6,8,12,16]:
    x=torch.randn(M,K)
    for f,name in [(lambda: ops.stream_linear(x,p,None,N),'ours'),(lambda: torch.nn.functional.linear(x,w),'torch')]:
        for _ in range(20): f()
        t=time.perf_counter(); n=300
        for _ in range(n): f()
        dt=(time.perf_counter()-t)/n
        print(M,name,f"{dt*1e6:.1f} us  {2*M*K*N/dt/1e9:.1f} GFLOPS")
