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


GROUP = 32


def quantize_q4_1_ref(weight: torch.Tensor):
    """GGUF Q4_1 as llama.cpp's reference quantiser writes it, per output and group of 32 inputs:
    m = min (float16), d = (max - min) / 15 (float16), q = round((w - min) / d) in 0..15; returns
    (the float32 weight the file stands for, d * q + m as gguf-py dequantises it, and q, d, m)."""
    N, K = weight.shape
    g = weight.float().reshape(N, K // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d32 = (hi - lo) / 15                                       # the codes come from the unrounded d
    inv = torch.where(d32 > 0, 1 / torch.where(d32 > 0, d32, torch.ones_like(d32)), torch.zeros_like(d32))
    q = ((g - lo[..., None]) * inv[..., None] + 0.5).floor().clamp(0, 15)
    d, m = d32.half().float(), lo.half().float()               # the file keeps float16 d and m
    w = (d[..., None] * q + m[..., None]).reshape(N, K)       # float32: d * q exact, + m rounded once
    return w, q.to(torch.uint8), d, m


def quantize_q8_0_ref(weight: torch.Tensor):
    """GGUF Q8_0: d = absmax / 127 (float16), q = round(w / d) in -127..127; returns (d * q as
    gguf-py dequantises it, q, d)."""
    N, K = weight.shape
    g = weight.float().reshape(N, K // GROUP, GROUP)
    d = (g.abs().amax(-1) / 127).half().float()
    q = torch.where(d[..., None] > 0, g / torch.where(d > 0, d, torch.ones_like(d))[..., None],
                    torch.zeros_like(g)).round().clamp(-127, 127)
    return (d[..., None] * q).reshape(N, K), q.to(torch.int8), d


def blocks_layout_ref(q: torch.Tensor, d: torch.Tensor, m, fmt: str):
    """Codes and scales of stream_linear_blocks by loops: q [N, G, 32] codes, d / m [N, G]."""
    N, G, _ = q.shape
    K = G * GROUP
    P = (N + BLOCK - 1) // BLOCK
    qf = q.reshape(N, K)
    codes = torch.zeros(P, K, BLOCK // 2 if fmt == "q4_1" else BLOCK,
                        dtype=torch.uint8 if fmt == "q4_1" else torch.int8)
    scales = torch.zeros(P, G, 2, BLOCK)
    for n in range(N):
        p, j = divmod(n, BLOCK)
        scales[p, :, 0, j] = d[n]
        if m is not None:
            scales[p, :, 1, j] = m[n]
        for k in range(K):
            if fmt == "q8_0":
                codes[p, k, j] = qf[n, k]
            elif j < 16:
                codes[p, k, j] |= qf[n, k]
            else:
                codes[p, k, j - 16] |= qf[n, k] << 4
    return codes, scales
