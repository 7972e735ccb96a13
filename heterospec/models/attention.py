"""Target attention backends over the static KV cache: prefix + tree with a custom mask.

Each target forward calls `backend.plan(...)` once (mask construction, FlashInfer planning), then
`backend.run(plan, q, k_cache, v_cache)` per layer after that layer's K/V rows are in the cache.

- "sdpa": torch scaled_dot_product_attention with the dense bool mask of
  `torch.ops.heterospec.dense_tree_attention_mask` ([B, T, width]); any device and dtype. On the
  CPU, a forward of at most TREE_ATTENTION_MAX_T tokens (a decode step, a tree verify) calls
  `torch.ops.heterospec.tree_attention` instead: the same attention without a mask tensor
  (``CPU_TREE_ATTENTION``).
- "flashinfer": `BatchPrefillWithPagedKVCacheWrapper` (CUDA, fp16/bf16). Each layer's cache
  [B, S_max, H_kv, D] is viewed as B pages of page_size = S_max (one page per request, last page
  length L_b + T); the bool custom mask comes from `torch.ops.heterospec.tree_attention_mask`.
  Every request contributes all T query rows (padding rows of a tree see only themselves).
- "auto": flashinfer on CUDA when importable and the dtype is fp16/bf16, else sdpa.
- GraphFlashInfer: the flashinfer backend with fixed buffers for CUDA-graph capture / replay
  (not picked by make_backend; build it with the batch size and maximum tree / KV lengths).
- SplitTreeAttention: prefix and tree as two passes merged by log-sum-exp; the prefix pass is
  FlashInfer in CUDA-graph mode (planned on the host from lengths only) or its torch reference.
  The engine's CUDA-graph verification uses it when the target's backend is flashinfer.
"""

from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass

import torch

from .. import ops
from .._checks import host_reads_allowed
from .kv_cache import KVCache
from .layers import sdpa

_FLASHINFER_WORKSPACE_BYTES = 128 << 20

# On the CPU, forwards of at most this many tokens per request attend with the tree_attention op
# (csrc/cpu/attention.cpp). Every decode step and every verified tree lies below it, so their rows
# share one kernel (the lossless check compares them); longer inputs (prefills) keep the flash
# kernel of scaled_dot_product_attention, built for long query blocks.
CPU_TREE_ATTENTION = True
TREE_ATTENTION_MAX_T = 64


def _tree_op_has_simd() -> bool:
    """Whether tree_attention runs a SIMD kernel here (x86 with AVX2 or AVX-512, csrc/cpu/isa.h).
    Its portable loop (other CPUs, ``HETEROSPEC_CPU_SCALAR=1``) is slower than the flash kernel."""
    return (platform.machine().lower() in ("x86_64", "amd64") and os.environ.get("HETEROSPEC_CPU_SCALAR") != "1"
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


_TREE_OP_SIMD = _tree_op_has_simd()


def causal_tree_mask(batch_size: int, T: int, device) -> torch.Tensor:
    """The tree of a plain sequence: [B, T, T] lower-triangular."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(batch_size, T, T)


@dataclass
class SdpaPlan:
    mask: torch.Tensor | None  # [B, T, W] bool; None: every query sees all W keys
    width: int


@dataclass
class TreeOpPlan:
    """A CPU forward of a few tokens: each layer calls tree_attention with these."""
    prefix_lens: torch.Tensor  # [B] int64
    tree_mask: torch.Tensor    # [B, T, T] bool, contiguous
    scale: float


def tree_op_serves(rows: int, prefix_lens: torch.Tensor, cache: KVCache) -> bool:
    """Whether tree_attention serves a forward of ``rows`` tokens per request over ``cache``: the
    CPU with a SIMD kernel for it, few tokens, a dtype it computes, and autograd off (the op has
    no backward; the engine decodes under inference mode). The target's layers and the draft's
    streamed steps (models/draft.py) ask the same question."""
    return (CPU_TREE_ATTENTION and _TREE_OP_SIMD and not prefix_lens.is_cuda
            and rows <= TREE_ATTENTION_MAX_T
            and cache.k.dtype in (torch.float32, torch.bfloat16, torch.float16) and not torch.is_grad_enabled())


_TREE_ATTENTION = torch.ops.heterospec.tree_attention.default


class SdpaAttention:
    name = "sdpa"

    def plan(self, tree_mask: torch.Tensor, prefix_lens: torch.Tensor, cache: KVCache, n_heads: int,
             scale: float) -> SdpaPlan:
        T = tree_mask.shape[1]
        S = cache.max_length
        self.scale = scale
        # On CPU attend only up to the longest request; on CUDA use S_max (no host sync).
        if prefix_lens.is_cuda or not host_reads_allowed(prefix_lens):
            width = S
        elif tree_op_serves(T, prefix_lens, cache):
            return TreeOpPlan(prefix_lens, tree_mask.contiguous(), scale)
        else:
            lens = prefix_lens.tolist()
            width = min(S, max(lens) + T)
            if T == 1 and min(lens) + 1 == width and bool(tree_mask.all()):
                # A decode step whose rows all see every key: no mask to build or apply (the
                # kernel gives the same bits as with an all-True one, tests/test_models_target.py).
                return SdpaPlan(None, width)
        return SdpaPlan(ops.dense_tree_attention_mask(tree_mask.contiguous(), prefix_lens, width), width)

    def run(self, plan: SdpaPlan | TreeOpPlan, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor) -> torch.Tensor:
        # q: [B, T, Hq, D]; k_cache, v_cache: [B, S_max, Hkv, D] -> [B, T, Hq, D]
        if isinstance(plan, TreeOpPlan):   # the raw op: it checks its inputs itself (the wrapper's
            # Python checks, once per layer, would cost as much as the attention)
            return _TREE_ATTENTION(q, k_cache, v_cache, plan.prefix_lens, plan.tree_mask, plan.scale)
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
        reserve_graph_rows(self._wrapper, B * max_tokens)
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


# ---------------------------------------------------------------------------------------------
# Prefix + tree as two passes (CUDA-graph replay of the verification with FlashInfer)
# ---------------------------------------------------------------------------------------------
def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs, the input's own dtype when wider (float64 in tests)."""
    return torch.promote_types(dtype, torch.float32)


@dataclass
class SplitPlan:
    tree_mask: torch.Tensor    # [B, T, T] bool
    prefix_lens: torch.Tensor  # [B] (device)
    T: int


class TorchPrefixPass:
    """The prefix pass in torch (any device): every query against keys ``[0, L_b)`` of its
    request, with the log-sum-exp. The reference :class:`FlashInferPrefixPass` is tested against
    on CPU; ``host_plan`` copies the host lengths into a fixed buffer, as FlashInfer's plan does."""

    def __init__(self):
        self._lens = None

    def host_plan(self, lens, T: int, n_heads: int, cache: KVCache, scale: float) -> None:
        dev = cache.k.device
        if self._lens is None or self._lens.shape[0] != len(lens) or self._lens.device != dev:
            self._lens = torch.zeros(len(lens), dtype=torch.int64, device=dev)
        self._lens.copy_(torch.tensor(lens, dtype=torch.int64))
        self.scale = scale

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        # q [B, T, Hq, D]; caches [B, S, Hkv, D] -> o [B, T, Hq, D] (q's dtype), lse [B, T, Hq] (>= float32)
        from .layers import expand_kv_heads
        Hq, acc = q.shape[2], _accumulation_dtype(q.dtype)
        k, v = expand_kv_heads(k_cache, Hq).to(acc), expand_kv_heads(v_cache, Hq).to(acc)
        s = torch.einsum("bthd,bshd->bhts", q.to(acc), k) * self.scale            # [B, Hq, T, S]
        keep = torch.arange(k.shape[1], device=q.device)[None, :] < self._lens[:, None]   # [B, S]
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)                                             # [B, Hq, T]
        o = torch.einsum("bhts,bshd->bthd", torch.softmax(s, dim=-1), v)
        return o.to(q.dtype), lse.transpose(1, 2)


def reserve_graph_rows(wrapper, rows: int) -> None:
    """Fix a CUDA-graph-mode FlashInfer wrapper's query-row capacity before its first ``plan``.

    FlashInfer (0.7.x) takes the capacity from the first plan's ``qo_indptr`` and refuses any later
    plan with more rows ("The total number of rows in qo_indptr ... cannot exceed ..."): planned
    first for a decode step (1 row), a wrapper could never verify a tree. The capacity also fixes
    the launch grid and the split-KV buffers, so it must not change once a graph is captured."""
    if getattr(wrapper, "_max_total_num_rows", None) is None:
        wrapper._max_total_num_rows = int(rows)


def _is_workspace_overflow(exc: BaseException) -> bool:
    msg = str(exc)
    return "Buffer overflow when allocating memory" in msg or "Increase the workspace buffer size" in msg


class FlashInferPrefixPass:
    """The prefix pass with FlashInfer's batch prefill in CUDA-graph mode (fixed index buffers,
    no mask): request b's cache slab is one page of ``S`` slots of which the first ``L_b`` hold
    its prefix. ``host_plan`` runs on the host before every capture and replay (lengths known
    there from the round's one read); FlashInfer returns the log-sum-exp in base 2.

    One wrapper per row class (``T`` rounded up to a power of two, at least 16): a CUDA-graph
    wrapper's row capacity is fixed at its first plan, and a graph replays only with the wrapper
    it was captured with, so the wrapper must be a function of ``T`` alone. The wrappers share a
    float workspace; a first plan that overflows it (FlashInfer sizes its split-KV buffers by the
    row capacity and the SM count: 416 MiB for a batch of 64 on an H200) gets a workspace twice
    as large, up to ``MAX_WORKSPACE_BYTES`` (earlier wrappers keep the one they were planned with)."""

    MIN_ROWS = 16
    MAX_WORKSPACE_BYTES = 8 << 30

    def __init__(self, device, batch_size: int, workspace_bytes: int = _FLASHINFER_WORKSPACE_BYTES):
        import flashinfer  # noqa: F401  (lazy: only on CUDA hosts; fail here, not at the first plan)

        self.device = device
        self.batch_size = batch_size
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._wrappers = {}   # row class -> wrapper (planned at least once)

    @classmethod
    def row_class(cls, T: int) -> int:
        return max(cls.MIN_ROWS, 1 << (int(T) - 1).bit_length())

    def _new_wrapper(self, rows: int):
        import flashinfer

        i32 = dict(dtype=torch.int32, device=self.device)
        B = self.batch_size
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD", use_cuda_graph=True, backend="fa2",
            qo_indptr_buf=torch.zeros(B + 1, **i32), paged_kv_indptr_buf=torch.zeros(B + 1, **i32),
            paged_kv_indices_buf=torch.zeros(B, **i32), paged_kv_last_page_len_buf=torch.zeros(B, **i32))
        reserve_graph_rows(w, B * rows)
        return w

    def host_plan(self, lens, T: int, n_heads: int, cache: KVCache, scale: float) -> None:
        B = len(lens)
        if B != self.batch_size:
            raise ValueError(f"FlashInferPrefixPass was built for batch {self.batch_size}, got {B} requests")
        S, n_kv, D, dtype = cache.max_length, cache.k.shape[3], cache.k.shape[4], cache.k.dtype
        if min(lens) < 1 or max(lens) + T > S:
            raise ValueError(f"prefix lengths {min(lens)}..{max(lens)} with a tree of {T} do not fit a cache of {S}")
        i32 = dict(dtype=torch.int32)
        args = (torch.arange(B + 1, **i32) * T, torch.arange(B + 1, **i32), torch.arange(B, **i32),
                torch.tensor(lens, **i32), n_heads, n_kv, D, S)
        kw = dict(causal=False, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
        rows = self.row_class(T)
        w = self._wrappers.get(rows)
        if w is not None:
            w.plan(*args, **kw)
            return
        w = self._new_wrapper(rows)
        while True:
            try:
                w.plan(*args, **kw)
                break
            except RuntimeError as exc:
                grow = 2 * self._workspace.numel()
                if not _is_workspace_overflow(exc) or grow > self.MAX_WORKSPACE_BYTES:
                    raise
                self._workspace = torch.empty(grow, dtype=torch.uint8, device=self.device)
                w = self._new_wrapper(rows)
        self._wrappers[rows] = w

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        B, T, Hq, D = q.shape
        w = self._wrappers.get(self.row_class(T))
        if w is None:
            raise RuntimeError(f"FlashInferPrefixPass: host_plan a [{B}, {T}] tree before running it")
        o, lse = w.run(q.reshape(B * T, Hq, D), (k_cache, v_cache), return_lse=True)
        return o.view(B, T, Hq, D), (lse.float() * math.log(2.0)).view(B, T, Hq)


class SplitTreeAttention:
    """Prefix + tree attention as two passes merged by log-sum-exp, for a verification that can
    be replayed as a CUDA graph with FlashInfer (docs/gpu.md section 4).

    Pass 1 (``prefix_pass``): every tree query against its request's committed prefix, no mask
    (:class:`FlashInferPrefixPass` on CUDA, planned on the host before each replay: a plan whose
    size never depends on the tree, unlike the packed custom mask). Pass 2, in torch: the tree
    queries against the tree's own K/V rows (cache slots ``L_b .. L_b + T - 1``, just written)
    with the ``[T, T]`` tree mask. The two key sets are disjoint and cover what the one-pass mask
    allows, so ``o = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2)`` is exact up to rounding; every
    query sees itself (pass 2) and a non-empty prefix (pass 1), so both parts are finite.

    Use: ``host_plan(prefix_lens_host, T, ...)`` before each verify forward (the engine's verify
    half does it); inside the forward ``plan`` only checks that the host plan matches."""

    name = "split-tree"

    def __init__(self, prefix_pass):
        self.prefix_pass = prefix_pass
        self._planned = None

    def host_plan(self, lens, T: int, n_heads: int, cache: KVCache, scale: float) -> None:
        self.prefix_pass.host_plan(list(lens), int(T), n_heads, cache, scale)
        self._planned = (len(lens), int(T))

    def plan(self, tree_mask: torch.Tensor, prefix_lens: torch.Tensor, cache: KVCache, n_heads: int,
             scale: float) -> SplitPlan:
        B, T = tree_mask.shape[:2]
        if self._planned != (B, T):
            raise RuntimeError(f"SplitTreeAttention: call host_plan for a [{B}, {T}] tree before the forward "
                               f"(last host plan: {self._planned})")
        self.scale = scale
        return SplitPlan(tree_mask, prefix_lens, T)

    def run(self, plan: SplitPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        from .layers import expand_kv_heads
        B, T, Hq, D = q.shape
        acc = _accumulation_dtype(q.dtype)
        o1, lse1 = self.prefix_pass.run(q, k_cache, v_cache)                     # [B, T, Hq, D], [B, T, Hq]
        slots = plan.prefix_lens[:, None] + torch.arange(T, device=q.device)     # [B, T]
        rows = torch.arange(B, device=q.device)[:, None]
        k_t = expand_kv_heads(k_cache[rows, slots], Hq).to(acc)                   # [B, T, Hq, D]
        v_t = expand_kv_heads(v_cache[rows, slots], Hq).to(acc)
        s = torch.einsum("bthd,bshd->bhts", q.to(acc), k_t) * self.scale         # [B, Hq, T, T]
        s = s.masked_fill(~plan.tree_mask[:, None], float("-inf"))
        lse2 = torch.logsumexp(s, dim=-1).transpose(1, 2)                        # [B, T, Hq]
        o2 = torch.einsum("bhts,bshd->bthd", torch.softmax(s, dim=-1), v_t)
        lse1 = lse1.to(acc)
        m = torch.maximum(lse1, lse2)
        w1, w2 = torch.exp(lse1 - m)[..., None], torch.exp(lse2 - m)[..., None]
        return ((o1.to(acc) * w1 + o2 * w2) / (w1 + w2)).to(q.dtype)


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
