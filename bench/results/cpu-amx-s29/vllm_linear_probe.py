"""vLLM 0.32.0 CPU float32 linear (onednn_mm, what vLLM dispatches for float32 weights) vs
heterospec.stream_linear vs F.linear over 30 layers of the SmolLM2-135M shapes (weights from
memory), in the vLLM environment:

    /tmp/vllm-venv/bin/python bench/results/cpu-amx-s29/vllm_linear_probe.py
"""
import os, sys, time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from vllm import _custom_ops as ops
import heterospec.ops as hops
torch.manual_seed(0)
shapes = [(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]
L = 30
W = [[torch.randn(o,i)*0.05 for (o,i) in shapes] for _ in range(L)]
H = [[ops.create_onednn_mm(w.t(), 32) for w in ws] for ws in W]
S = [[hops.stream_linear_pack(w) for w in ws] for ws in W]
F = torch.nn.functional
def run(kind, x):
    for l in range(L):
        for j,(o,i) in enumerate(shapes):
            xi = x[j>=6]
            if kind == 0: ops.onednn_mm(H[l][j], xi, None)
            elif kind == 1: hops.stream_linear(xi, S[l][j], None, o)
            else: F.linear(xi, W[l][j])
with torch.inference_mode():
    for M in (1,2,4,8,16):
        x=(torch.randn(M,576), torch.randn(M,1536))
        a=ops.onednn_mm(H[0][4], x[0], None); b=hops.stream_linear(x[0], S[0][4], None, 1536)
        assert torch.allclose(a,b,atol=1e-4)
        t={0:[],1:[],2:[]}
        for rep in range(5):
            for k in (0,1,2):
                t0=time.perf_counter(); run(k,x); t[k].append(time.perf_counter()-t0)
        print(f"M={M:2d} vllm onednn_mm {1e3*min(t[0]):6.2f}  stream {1e3*min(t[1]):6.2f}  F.linear {1e3*min(t[2]):6.2f} ms", flush=True)
