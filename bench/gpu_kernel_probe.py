"""How verify_sampling and topk_entropy scale on a GPU (a diagnosis for issue 12, not a benchmark).

Times each op over a grid (GPU time per call, as bench/bench_ops_cuda.py times) next to a torch
reduction that reads the same bytes, so the gap says whether a kernel is bound by memory,
by latency (one block per row) or by its own work:

    python bench/gpu_kernel_probe.py            # needs CUDA and the built ops
"""

from __future__ import annotations

import torch

import heterospec  # noqa: F401 (registers torch.ops.heterospec)
from bench_ops_cuda import gpu_us  # bench/ is on sys.path when this file runs as a script

hs = torch.ops.heterospec


def chain_tree(B: int, T: int, V: int, gen):
    """B chains of T nodes (node i's only child is i + 1); tokens random."""
    fc = torch.arange(1, T + 1, device="cuda").repeat(B, 1)
    fc[:, -1] = -1
    ns = torch.full((B, T), -1, device="cuda", dtype=torch.int64)
    tokens = torch.randint(0, V, (B, T), generator=gen, device="cuda")
    n = torch.full((B,), T, device="cuda", dtype=torch.int64)
    return tokens, fc, ns, n


def verify_sampling_grid() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("verify_sampling: B, T, V, accepted chain length -> us; torch row-sum of the same rows")
    for V in (32000, 128256):
        for B in (1, 8):
            T = 16
            tokens, fc, ns, n = chain_tree(B, T, V, gen)
            probs = torch.softmax(torch.randn(B, T, V, generator=gen, device="cuda") * 3, -1)
            coins = torch.rand(B, T, generator=gen, device="cuda")
            final = torch.rand(B, generator=gen, device="cuda")
            for accept in (0, 4, 15):
                p = probs.clone()
                if accept:   # nodes 0..accept-1 put all mass on their child's token: accepted
                    rows = torch.arange(accept, device="cuda")[None, :]
                    p[:, :accept] = 0
                    p[torch.arange(B, device="cuda")[:, None], rows, tokens[:, 1:accept + 1]] = 1.0
                t = gpu_us(lambda: hs.verify_sampling(tokens, p, fc, ns, n, coins, final))
                alen = int(hs.verify_sampling(tokens, p, fc, ns, n, coins, final)[1][0])
                ref = gpu_us(lambda: p[:, :accept + 1].sum(-1))
                print(f"  B={B} T={T} V={V} accepted={alen}: {t:8.1f} us   torch sum of {accept + 1} rows: {ref:6.1f} us")


def topk_entropy_grid() -> None:
    print("topk_entropy: M, V, dtype, k -> us, TB/s; torch amax of the same tensor")
    for M, V, dtype in ((64, 128256, torch.bfloat16), (512, 128256, torch.bfloat16), (2048, 128256, torch.bfloat16),
                        (512, 128256, torch.float32), (512, 32000, torch.bfloat16)):
        x = (torch.randn(M, V, device="cuda") * 3).to(dtype)
        nbytes = x.numel() * x.element_size()
        ref = gpu_us(lambda: x.amax(-1))
        for k in (1, 8, 64):
            t = gpu_us(lambda: hs.topk_entropy(x, k, None))
            print(f"  M={M} V={V} {str(dtype)[6:]} k={k}: {t:8.1f} us {nbytes / t / 1e6:6.2f} TB/s   "
                  f"amax: {ref:7.1f} us {nbytes / ref / 1e6:6.2f} TB/s")


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    verify_sampling_grid()
    topk_entropy_grid()
