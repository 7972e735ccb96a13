"""References of stream_linear_pack / stream_linear: the layout and the product, in plain PyTorch."""

import torch

BLOCK = 32


def stream_linear_pack_ref(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 32), K, 32]: block p, input k, lane j holds weight[32 p + j, k]
    (0 past N)."""
    N, K = weight.shape
    P = (N + BLOCK - 1) // BLOCK
    padded = torch.zeros(P * BLOCK, K, dtype=weight.dtype)
    padded[:N] = weight
    out = torch.empty(P, K, BLOCK, dtype=weight.dtype)
    for p in range(P):
        for j in range(BLOCK):
            out[p, :, j] = padded[p * BLOCK + j]
    return out


def stream_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x @ weight.T + bias in float64, rounded once to x's dtype (float32 or bfloat16)."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)
