"""Llama building blocks shared by the target and the EAGLE-3 draft.

RMSNorm, rotary embedding (HF "rotate-half" convention, inverse frequencies from transformers'
rope functions so every `rope_type` works), a Q/K/V/O projection block and the SwiGLU MLP.
Attention itself lives in `attention.py` (target) and `draft.py` (draft): these modules only
project and rotate.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .linear import keep_block_source


# On the CPU a layer's glue - each RMSNorm, and the rotation of Q and K - runs as one op each
# (``torch.ops.heterospec.rms_norm`` / ``rope``, csrc/cpu/norm_rope.cpp) instead of several
# small ATen ops: at the few rows of a decode step or a tree verify their dispatch cost more than
# their arithmetic. Same rounding as the formulas below (RoPE bit for bit; RMSNorm's sum of
# squares in double). Set False to run the formulas (A/B benchmarks); autograd always does.
CPU_GLUE_OPS = True
_GLUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_glue_loaded = None


def _glue(*tensors: torch.Tensor) -> bool:
    """Whether these tensors (the first sets the dtype) go through the glue ops."""
    global _glue_loaded
    if not CPU_GLUE_OPS:
        return False
    if _glue_loaded is None:
        _glue_loaded = hasattr(torch.ops.heterospec, "rms_norm") and hasattr(torch.ops.heterospec, "rope")
    x = tensors[0]
    if not _glue_loaded or x.device.type != "cpu" or x.dtype not in _GLUE_DTYPES:
        return False
    if any(t.dtype != x.dtype for t in tensors[1:]):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in float32, cast back, then scale (same rounding as HF)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _glue(x, self.weight) and x.dim() >= 1:
            return torch.ops.heterospec.rms_norm.default(x, self.weight, self.eps)
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the same arithmetic in one fused kernel (no cast to round): ~2/3 of the time on CPU
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


# ---------------------------------------------------------------------------------------------
# RoPE


def rope_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32, CPU) and the cos/sin scaling of a config.

    `hf_config` is a transformers `LlamaConfig` (legacy `rope_theta` / `rope_scaling` keys are
    standardised into `rope_parameters` by transformers). `rope_type` "default" uses the plain
    formula, anything else goes through `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`
    (llama3, linear, yarn, dynamic, longrope, ...). Dynamic types are evaluated once, at their
    initial (un-grown) length, which is what HF does for sequences within max_position_embeddings.
    """
    with torch.device("cpu"):  # also when the caller builds its modules under torch.device("meta")
        return _rope_inv_freq(hf_config)


def _rope_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(hf_config.rope_parameters or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if rope_type == "default":
        base = float(params.get("rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
    else:
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope_type: {rope_type!r}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    inv_freq = inv_freq.float().cpu()
    if inv_freq.numel() * 2 != head_dim:
        raise ValueError(
            f"partial rotary embeddings are not supported (rotary dim {inv_freq.numel() * 2}, head_dim {head_dim})"
        )
    return inv_freq, float(scaling)


def rope_exact_length(hf_config) -> int | None:
    """The longest sequence our fixed frequency table reproduces transformers for, or None (any).

    transformers recomputes the table from the current length for two rope types: "dynamic"
    (NTK) grows the base past ``max_position_embeddings``, "longrope" switches to its long
    factors past ``original_max_position_embeddings``, and both rewrite the angles of positions
    already cached. A static KV cache cannot follow that, so caches are capped at this length
    (a clear error beyond it rather than silently different logits)."""
    params = dict(hf_config.rope_parameters or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "dynamic":
        return int(hf_config.max_position_embeddings)
    if rope_type == "longrope":
        orig = params.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None) or hf_config.max_position_embeddings
        return int(orig)
    return None


class Rotary(nn.Module):
    """cos/sin tables computed on the fly from explicit positions (no max-length table).

    ``inv_freq`` stays float32 whatever dtype the module is cast to: in bfloat16 the angles of
    position 3000 would be off by up to half a radian, and drafts are trained with float32 RoPE."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0, exact_length: int | None = None,
                 rope_type: str = "default"):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = scaling
        self.exact_length = exact_length
        self.rope_type = rope_type

    def _apply(self, fn, recurse=True):
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(device=self.inv_freq.device)   # follow devices, never dtypes
        return self

    def check_length(self, max_length: int, what: str) -> None:
        if self.exact_length is not None and max_length > self.exact_length:
            raise ValueError(
                f"{what}: max_length {max_length} exceeds {self.exact_length}, the longest context this "
                f"model's {self.rope_type!r} RoPE supports here (transformers rescales its frequencies past "
                f"that length, which a static KV cache cannot follow); use max_length <= {self.exact_length}")

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [..., T] int64 -> cos, sin: [..., T, D] in `dtype`
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, H, D]; cos, sin: [B, T, D]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """:func:`apply_rope` of queries and keys: one op on the CPU (see ``CPU_GLUE_OPS``) where the
    tables are per token (``[B, T, D]``); tables that broadcast take the formula."""
    if (q.dim() == 4 and k.dim() == 4 and k.shape[:2] == q.shape[:2]
            and cos.shape == sin.shape == (q.shape[0], q.shape[1], q.shape[3]) and _glue(q, k, cos, sin)):
        return torch.ops.heterospec.rope.default(q, k, cos, sin)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


# ---------------------------------------------------------------------------------------------
# Projections


class QKVO(nn.Module):
    """Q/K/V/O projections with RoPE; `in_dim` is H for the target and 2H for the EAGLE-3 draft."""

    # Q, K and V read the same input: on CPU the tuned linears may run them as one call
    # (models/linear.py, FusedStream), set here as ``_fused``.
    FUSABLE = ("q_proj", "k_proj", "v_proj")
    _fused = None

    def __init__(self, in_dim: int, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, bias: bool = False):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv_heads})")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(in_dim, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=bias)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # x: [B, T, in_dim] -> q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (q, k rotated)
        B, T, _ = x.shape
        fused = self._fused(x) if self._fused is not None else None
        q, k, v = fused if fused is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        q, k = rope_qk(q, k, cos, sin)
        return q, k, v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        # o: [B, T, Hq, D] -> [B, T, hidden]
        return self.o_proj(o.flatten(-2))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    FUSABLE = ("gate_proj", "up_proj")     # one input: may run as one call (see QKVO)
    _fused = None

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self._fused(x) if self._fused is not None else None
        gate, up = fused if fused is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)


# ---------------------------------------------------------------------------------------------
# Attention over explicit keys (used by the draft and the SDPA backend)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D]; mask: [B, Tq, Tk] bool (True = attend), or None:
    every query attends to every key.

    Returns [B, Tq, Hq, D]. Every query row must see at least one key.

    On CPU a bfloat16 / float16 attention runs in float32 (inputs upcast, output cast back):
    PyTorch's CPU flash kernel in bf16 is several times slower than in float32 at one query row (a
    decode step) and no faster at tree sizes (bench/RESULTS.md), and float32 accumulates more exactly. One rule for every
    query length, so the one-token and the tree forward round alike.
    """
    dtype = q.dtype
    if q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        q, k, v = q.float(), k.float(), v.float()
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = q.shape[1] != k.shape[1]
    with attention_backends(q):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None], scale=scale,
                                           enable_gqa=gqa)
    return o.transpose(1, 2).to(dtype)


# scaled_dot_product_attention's backends other than cuDNN's. PyTorch prefers cuDNN attention on
# Hopper, and cuDNN builds an execution plan for every new shape it meets (tens of ms each on an
# H100): a prompt of a new length paid it in the draft's prompt pass (bench/RESULTS.md, sixty-fifth
# session). The others choose a kernel per call at no cost.
_SHAPE_FREE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(q: torch.Tensor):
    """The backends an attention on ``q``'s device may use: on CUDA outside a graph capture,
    every backend but cuDNN (an eager call's shapes change from call to call: prompt lengths,
    pending extends, a configuration's first round); under capture, PyTorch's own choice (one
    shape, planned once per graph, and cuDNN is the fused kernel that takes a mask with grouped
    KV heads: without it the target's masked GQA attention falls back to the math kernel in
    every replay); elsewhere, PyTorch's own choice."""
    if q.is_cuda and not torch.cuda.is_current_stream_capturing():
        return sdpa_kernel(_SHAPE_FREE_BACKENDS)
    return contextlib.nullcontext()


def expand_kv_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, Hkv, D] -> [B, T, n_heads, D], query head h reading KV head h // (n_heads / Hkv)
    (the grouping of ``enable_gqa``). Returns ``x`` itself when Hkv == n_heads, else a copy."""
    B, T, Hkv, D = x.shape
    if Hkv == n_heads:
        return x
    return x[:, :, :, None].expand(B, T, Hkv, n_heads // Hkv, D).reshape(B, T, n_heads, D)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = attend) -> the same mask as an additive float tensor (0 / -inf) of `dtype`."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def sdpa_kernel_friendly(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """`sdpa` in the form CUDA's fused kernels accept: KV heads expanded to the query heads (no
    ``enable_gqa``, which the memory-efficient kernel rejects) and an additive float mask in the
    query dtype. With ``enable_gqa`` and a bool mask PyTorch falls back to the math kernel on
    CUDA; this form keeps the memory-efficient kernel eligible (flash takes no mask at all).

    q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv or Hq, D]; mask: [B, Tq, Tk] bool (True = attend) or an
    additive float mask of q's dtype. Same result as `sdpa` up to rounding; masked keys must hold
    finite values (an additive -inf does not hide a NaN key the way a bool mask does).
    """
    Hq = q.shape[2]
    k, v = expand_kv_heads(k, Hq), expand_kv_heads(v, Hq)
    m = additive_mask(mask, q.dtype) if mask.dtype == torch.bool else mask
    with attention_backends(q):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=m[:, None], scale=scale)
    return o.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Loading


def load_weight_file(f: str) -> dict:
    """Tensors of one ``*.safetensors`` or ``pytorch_model*.bin`` file; a damaged file is a clear error."""
    try:
        if f.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(f)
        return dict(torch.load(f, map_location="cpu", weights_only=True))
    except Exception as e:  # safetensors / pickle raise their own types for damaged files
        raise ValueError(f"cannot read weights from {f}: the file is corrupt or truncated "
                         f"({type(e).__name__}: {e})") from e


def assign_weights(module: nn.Module, tensors, dtype: torch.dtype, device, *, requires_grad: bool,
                   what: str, skip: tuple[str, ...] = ()) -> None:
    """Replace every parameter / persistent buffer of `module` (possibly built on "meta") by
    `tensors[name]`, floating tensors cast to `dtype`, all moved to `device`.

    Missing names and shape mismatches raise, naming `what` (the checkpoint). Names in `skip` are
    left alone (e.g. a tied lm_head).
    """
    expected = module.state_dict(keep_vars=True)
    missing = [n for n in expected if n not in tensors and n not in skip]
    if missing:
        raise KeyError(f"{what}: missing weights {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    for name, ref in expected.items():
        if name in skip:
            continue
        t = tensors[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"{what}: weight {name} has shape {list(t.shape)}, expected {list(ref.shape)}")
        source = t
        t = t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device=device)
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if attr in owner._parameters:
            param = nn.Parameter(t, requires_grad=requires_grad)
            if attr == "weight" and isinstance(owner, (nn.Linear, nn.Embedding)):
                keep_block_source(param, source)      # (a float32 checkpoint's codes, for bfloat16)
            setattr(owner, attr, param)
        else:
            owner._buffers[attr] = t
