"""References of rms_norm / rope: the Llama formulas in plain PyTorch (HF's rounding)."""

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * cast(x32 / sqrt(mean(x32^2) + eps)): the mean in float64, the rest as HF rounds it."""
    x32 = x.float()
    inv = (x.double().pow(2).mean(-1, keepdim=True) + eps).rsqrt().float()
    return weight * (x32 * inv).to(x.dtype)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] * cos + rotate_half(x) * sin, cos / sin [B, T, D], in x's dtype."""
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos[:, :, None] + rot * sin[:, :, None]
