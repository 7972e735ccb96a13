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


def rope_kv_write_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prefix_lens: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int):
    """Split qkv [B, T, (Hq + 2 Hkv) D] into Q, K, V heads; -> (rope_ref(q), k_cache', v_cache'),
    the caches copied with rope_ref(k) and v written at slots prefix_lens[b] + t."""
    B, T, _ = qkv.shape
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.split([num_heads * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.reshape(B, T, num_heads, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
    kc, vc = k_cache.clone(), v_cache.clone()
    k = rope_ref(k, cos, sin)
    for b in range(B):
        p = int(prefix_lens[b])
        kc[b, p:p + T], vc[b, p:p + T] = k[b], v[b]
    return rope_ref(q, cos, sin), kc, vc


def tree_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_lens: torch.Tensor,
                       tree_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Row (b, t, h) over slots s < L_b and L_b + j with tree_mask[b, t, j], KV head h // (Hq // Hkv):
    an explicit loop in float64, rounded to q's dtype."""
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    out = torch.empty(B, T, Hq, D, dtype=torch.float64)
    for b in range(B):
        L = int(prefix_lens[b])
        for t in range(T):
            slots = list(range(L)) + [L + j for j in range(tree_mask.shape[2]) if bool(tree_mask[b, t, j])]
            for h in range(Hq):
                g = h // (Hq // Hkv)
                k = k_cache[b, slots, g].double()
                v = v_cache[b, slots, g].double()
                w = torch.softmax((k @ q[b, t, h].double()) * scale, dim=0)
                out[b, t, h] = w @ v
    return out.to(q.dtype)
