"""Target attention backends over the static KV cache: prefix + tree with a custom mask.

Each target forward calls `backend.plan(...)` once (mask construction, FlashInfer planning), then
`backend.run(plan, q, k_cache, v_cache)` per layer after that layer's K/V rows are in the cache.

- "sdpa": torch scaled_dot_product_attention with the dense bool mask of
  `torch.ops.heterospec.dense_tree_attention_mask` ([B, T, width]); any device and dtype.
- "flashinfer": `BatchPrefillWithPagedKVCacheWrapper` (CUDA, fp16/bf16). Each layer's cache
  [B, S_max, H_kv, D] is viewed as B pages of page_size = S_max (one page per request, last page
  length L_b + T); the bool custom mask comes from `torch.ops.heterospec.tree_attention_mask`.
  Every request contributes all T query rows (padding rows of a tree see only themselves).
- "auto": flashinfer on CUDA when importable and the dtype is fp16/bf16, else sdpa.
- GraphFlashInfer: the flashinfer backend with fixed buffers for CUDA-graph capture / replay
  (not picked by make_backend; build it with the batch size and maximum tree / KV lengths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from .._checks import host_reads_allowed
from .kv_cache import KVCache
from .layers import sdpa

_FLASHINFER_WORKSPACE_BYTES = 128 << 20


def causal_tree_mask(batch_size: int, T: int, device) -> torch.Tensor:
    """The tree of a plain sequence: [B, T, T] lower-triangular."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(batch_size, T, T)


@dataclass
class SdpaPlan:
    mask: torch.Tensor  # [B, T, W] bool
    width: int


class SdpaAttention:
    name = "sdpa"

    def plan(self, tree_mask: torch.Tensor, prefix_lens: torch.Tensor, cache: KVCache, n_heads: int,
             scale: float) -> SdpaPlan:
        T = tree_mask.shape[1]
        S = cache.max_length
        # On CPU attend only up to the longest request; on CUDA use S_max (no host sync).
        width = S if prefix_lens.is_cuda or not host_reads_allowed(prefix_lens) else \
            min(S, int(prefix_lens.max()) + T)
        self.scale = scale
        return SdpaPlan(ops.dense_tree_attention_mask(tree_mask.contiguous(), prefix_lens, width), width)

    def run(self, plan: SdpaPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        # q: [B, T, Hq, D]; k_cache, v_cache: [B, S_max, Hkv, D] -> [B, T, Hq, D]
        W = plan.width
        return sdpa(q, k_cache[:, :W], v_cache[:, :W], plan.mask, self.scale)


class FlashInferAttention:
    """Paged batch prefill with a custom mask (GPU only; written without a GPU to test on)."""

    name = "flashinfer"

    def __init__(self, device: torch.device):
        import flashinfer  # lazy: only on CUDA hosts

        self._workspace = torch.empty(_FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # fa2 explicitly: the wrapper keeps the backend of its first plan(), and fa3 (picked on
        # Hopper for a plan without a mask) rejects custom masks later.
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD",
                                                                       backend="fa2")

    def plan(self, tree_mask: torch.Tensor, prefix_lens: torch.Tensor, cache: KVCache, n_heads: int,
             scale: float):
        B, T, _ = tree_mask.shape
        dev = tree_mask.device
        S, n_kv, D, dtype = cache.max_length, cache.k.shape[3], cache.k.shape[4], cache.k.dtype
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flashinfer backend needs float16 or bfloat16, got {dtype}")
        num_nodes = torch.full((B,), T, dtype=torch.long, device=dev)
        kv_lens = prefix_lens + T  # [B]
        total, worst = torch.stack([kv_lens.sum(), kv_lens.max()]).tolist()  # plan() syncs anyway
        if worst > S:
            # FlashInfer would read the next request's page (or past the cache) without a word.
            raise ValueError(f"tree of {T} tokens after a prefix of {worst - T} overflows the KV cache "
                             f"(max_length {S})")
        mask_numel = T * int(total)
        custom_mask, _ = ops.tree_attention_mask(tree_mask.contiguous(), num_nodes, prefix_lens, mask_numel)
        assert custom_mask.dtype == torch.bool and custom_mask.numel() == mask_numel, "custom_mask size mismatch"
        i32 = dict(dtype=torch.int32, device=dev)
        qo_indptr = torch.arange(B + 1, **i32) * T
        kv_indptr = torch.arange(B + 1, **i32)  # one page per request
        kv_indices = torch.arange(B, **i32)  # page b = request b's [S_max, H, D] slab
        self._wrapper.plan(
            qo_indptr, kv_indptr, kv_indices, kv_lens.to(torch.int32),
            n_heads, n_kv, D, S,
            custom_mask=custom_mask, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale,
        )
        return (B, T)

    def run(self, plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        # q: [B, T, Hq, D]; k_cache, v_cache: [B, S_max, Hkv, D] (= [pages, page_size, Hkv, D])
        B, T = plan
        o = self._wrapper.run(q.reshape(B * T, q.shape[2], q.shape[3]), (k_cache, v_cache))
        return o.view(B, T, q.shape[2], q.shape[3])


class GraphFlashInfer(FlashInferAttention):
    """FlashInfer in CUDA-graph mode (docs/gpu.md section 3): the wrapper owns fixed index and
    mask buffers (``use_cuda_graph=True``), so a graph captured around ``run`` stays valid when
    ``plan`` writes new lengths and mask bits into the same buffers.

    Use: call ``plan(...)`` on the host (outside any capture) before every capture and every
    replay, for the tree shape ``[B, T]`` the graph was captured with; inside a capture ``plan``
    only returns the plan of the last host-side call (FlashInfer's ``plan`` syncs and cannot be
    captured). ``T <= max_tokens`` query rows and ``L_b + T <= max_kv`` keys per request.

    Import-safe without flashinfer: it is imported only when an instance is built (CUDA hosts).
    """

    name = "flashinfer-graph"

    def __init__(self, device, batch_size: int, max_tokens: int, max_kv: int):
        import flashinfer  # lazy: only on CUDA hosts

        i32 = dict(dtype=torch.int32, device=device)
        B = batch_size
        self.batch_size, self.max_tokens, self.max_kv = B, max_tokens, max_kv
        self._workspace = torch.empty(_FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD", use_cuda_graph=True, backend="fa2",
            qo_indptr_buf=torch.zeros(B + 1, **i32), paged_kv_indptr_buf=torch.zeros(B + 1, **i32),
            paged_kv_indices_buf=torch.zeros(B, **i32), paged_kv_last_page_len_buf=torch.zeros(B, **i32),
            custom_mask_buf=torch.zeros(B * (-(-max_tokens * max_kv // 8) + 1), dtype=torch.uint8, device=device),
            mask_indptr_buf=torch.zeros(B + 1, **i32))
        self._planned = None

    def plan(self, tree_mask: torch.Tensor, prefix_lens: torch.Tensor, cache: KVCache, n_heads: int,
             scale: float):
        if tree_mask.is_cuda and torch.cuda.is_current_stream_capturing():
            if self._planned != tuple(tree_mask.shape[:2]):
                raise RuntimeError(f"GraphFlashInfer: plan the tree shape {tuple(tree_mask.shape[:2])} on the host "
                                   f"before capturing (last plan: {self._planned})")
            return self._planned
        B, T = tree_mask.shape[:2]
        if B != self.batch_size or T > self.max_tokens:
            raise ValueError(f"GraphFlashInfer was built for batch {self.batch_size} and <= {self.max_tokens} "
                             f"tree tokens, got a [{B}, {T}] tree")
        self._planned = super().plan(tree_mask, prefix_lens, cache, n_heads, scale)
        return self._planned


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


def make_backend(name: str, device: torch.device, dtype: torch.dtype):
    device = torch.device(device)
    if name == "auto":
        ok = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flashinfer_available()
        name = "flashinfer" if ok else "sdpa"
    if name == "sdpa":
        return SdpaAttention()
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend needs a CUDA device, the model is on {device}")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flashinfer attention backend needs float16 or bfloat16 weights, got {dtype}")
        if not flashinfer_available():
            raise ImportError("attn_backend='flashinfer' but flashinfer cannot be imported")
        return FlashInferAttention(device)
    raise ValueError(f"unknown attention backend {name!r} (expected 'auto', 'sdpa' or 'flashinfer')")
