"""Typed wrappers and fake kernels for the ``torch.ops.heterospec`` operators.

Each public function validates its arguments' metadata (dtype, rank, device, sizes; no device
synchronisation) and calls ``torch.ops.heterospec.<op>.default``. The C++ kernels validate the
values (ranges, tree links) and raise ``ValueError`` naming the tensor and the problem.
Every op has a ``torch.library.register_fake`` implementation below, so the wrappers trace under
``torch.compile(fullgraph=True)``.

Conventions (docs/design.md): ``B`` requests, tree capacity ``T`` (position 0 = root), index
tensors ``int64`` with ``-1`` as the "none / padding" sentinel.
"""

from __future__ import annotations

import functools
import math
import inspect
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._ext import ensure_ops as _ensure_ops
from ._checks import FLOAT_LOGITS, check_int, check_size, check_tensor

_ensure_ops()  # defines the op schemas (heterospec._C or the JIT-built library); must precede register_fake

#: Every op of the library, in design-doc order (each has a wrapper of the same name below).
OP_NAMES = (
    "topk_entropy",
    "entropy_bin_policy",
    "select_tree_nodes",
    "build_tree",
    "tree_attention_mask",
    "dense_tree_attention_mask",
    "verify_greedy",
    "verify_sampling",
    "compact_kv_",
    "stream_linear_pack",
    "stream_linear",
    "stream_linear_blocks",
    "rms_norm",
    "rope",
    "rope_kv_write_",
    "tree_attention",
    "decoder_layer_",
    "decoder_layers_",
    "corpus_lookup",
    "greedy_tokens",
    "sample_tokens",
)

#: Ops with CPU kernels only (no CUDA kernel: on a GPU the stock linear is already flat, a
#: replayed CUDA graph already runs the layer glue without per-op dispatch, and FlashInfer
#: attends to a tree with its custom mask; corpus_lookup is a host op whatever the device; a GPU's
#: argmax is already a bandwidth-bound reduction, where greedy_tokens fixes the CPU's; a GPU
#: samples with torch's sort and cumsum, which a captured CUDA graph replays at fixed shapes).
CPU_ONLY_OPS = ("stream_linear_pack", "stream_linear", "stream_linear_blocks", "rms_norm", "rope", "rope_kv_write_",
                "tree_attention", "decoder_layer_", "decoder_layers_", "corpus_lookup", "greedy_tokens",
                "sample_tokens")

#: Sync-free error flags of the CUDA ops and the host-side checks that raise the CPU ops' errors.
ERROR_HELPERS = (
    "topk_entropy_invalid",
    "raise_topk_entropy_errors",
    "verify_sampling_invalid",
    "raise_verify_sampling_errors",
)

__all__ = [*OP_NAMES, *ERROR_HELPERS, "OP_NAMES", "ERROR_HELPERS", "CPU_ONLY_OPS", "MAX_TOPK", "CORPUS_SEP",
           "STREAM_BLOCK", "STREAM_DTYPES", "STREAM_WEIGHT_DTYPES", "STREAM_GROUP", "BLOCK_FORMATS",
           "stream_linear_pack_blocks"]

_ops = torch.ops.heterospec

#: Largest ``k`` accepted by :func:`topk_entropy`.
MAX_TOPK = 64

#: Outputs per block of :func:`stream_linear_pack`'s layout.
STREAM_BLOCK = 32

#: Input / result dtypes of :func:`stream_linear` (weights of the same dtype, or float16 weights
#: with float32 inputs).
STREAM_DTYPES = (torch.float32, torch.bfloat16)

#: Weight dtypes :func:`stream_linear_pack` packs.
STREAM_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_i64 = torch.int64


def _fake(op: str):
    """``register_fake`` for ``heterospec::<op>``, plus the one check a fake must make itself:
    every tensor on one device. A raw call mixing devices (say CPU and meta) dispatches to the
    fake kernel, which would otherwise hand back uninitialised tensors instead of an error."""

    def register(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def fake(*args, **kwargs):
            named = [(n, v) for n, v in sig.bind(*args, **kwargs).arguments.items() if isinstance(v, Tensor)]
            first, ref = named[0]
            for name, t in named[1:]:
                check_tensor(op, name, t, device=ref.device, device_of=first)
            return fn(*args, **kwargs)

        torch.library.register_fake(f"heterospec::{op}")(fake)
        return fn

    return register


def _vec(op: str, name: str, x: Tensor, B: int, device: torch.device, ref: str) -> None:
    """A per-request ``[B]`` int64 vector on ``device``."""
    check_tensor(op, name, x, dtype=_i64, ndim=1, layout="[B]", device=device, device_of=ref)
    check_size(op, name, x, 0, B, f"B = {ref}.size(0)")


# ---------------------------------------------------------------------------------------------
# 1. topk_entropy
# ---------------------------------------------------------------------------------------------
def topk_entropy(
    logits: Tensor, k: int, parent_entropy: Optional[Tensor] = None, *, check_finite: bool = False
) -> Tuple[Tensor, Tensor, Tensor]:
    """Top-k log-probabilities of each row plus the cumulative (path) Top-K entropy.

    One pass over the vocabulary per row (online max / sum-exp with a running top-k).

    Parameters
    ----------
    logits : Tensor
        ``[M, V]`` float32, float16 or bfloat16; any row stride. ``-inf`` entries (masked
        vocabulary) are allowed; ``M = 0`` is allowed.
    k : int
        Number of top entries, ``1 <= k <= min(V, 64)``.
    parent_entropy : Tensor, optional
        ``[M]`` float32, the path entropy of each row's parent (zeros when ``None``).
    check_finite : bool
        CUDA only flags invalid rows (see Notes); with ``True`` the wrapper raises the CPU op's
        ``ValueError`` on them (one device sync). CPU always raises.

    Returns
    -------
    topk_logprobs : Tensor
        ``[M, k]`` float32, ``logits[id] - logsumexp(row)``, sorted descending.
    topk_ids : Tensor
        ``[M, k]`` int64 vocabulary ids; ties broken by the lower id.
    path_entropy : Tensor
        ``[M]`` float32, ``parent_entropy + H`` with ``H = -sum_i q_i log q_i`` over the top-k
        probabilities renormalised to sum to one (natural log, ``0 log 0 = 0``).

    Raises
    ------
    ValueError
        Bad dtype / rank / device, ``k`` out of range, or (CPU, or CUDA with ``check_finite``) a
        row with NaN, ``+inf`` or only ``-inf`` logits.

    Notes
    -----
    Invalid rows on CUDA (no host sync): a row with NaN, ``+inf`` or only ``-inf`` logits gets
    ``topk_logprobs = -inf``, ``topk_ids = 0..k-1`` (valid ids, safe to gather or embed) and
    ``path_entropy = NaN`` (which :func:`entropy_bin_policy` puts in the last bin). Such
    candidates are never selected (:func:`select_tree_nodes` treats ``-inf`` as invalid) and sort
    last. A valid row's ``topk_logprobs[:, 0]`` is always finite, so
    :func:`topk_entropy_invalid` (``topk_logprobs[:, 0] == -inf``) is the per-row error flag: pack
    it into the round's one device-to-host read and call :func:`raise_topk_entropy_errors`, which
    raises the CPU op's ``ValueError``.
    """
    op = "topk_entropy"
    check_tensor(op, "logits", logits, dtype=FLOAT_LOGITS, ndim=2, layout="[M, V]")
    check_int(op, "k", k)
    V = logits.size(1)
    if isinstance(k, int) and isinstance(V, int) and not 1 <= k <= min(V, MAX_TOPK):
        raise ValueError(
            f"{op}: expected 1 <= k <= min(V, {MAX_TOPK}) = {min(V, MAX_TOPK)} "
            f"(V = logits.size(1) = {V}), got k = {k}"
        )
    if parent_entropy is not None:
        check_tensor(op, "parent_entropy", parent_entropy, dtype=torch.float32, ndim=1, layout="[M]",
                     device=logits.device, device_of="logits")
        check_size(op, "parent_entropy", parent_entropy, 0, logits.size(0), "M = logits.size(0)")
    out = _ops.topk_entropy.default(logits, k, parent_entropy)
    if check_finite and not torch.compiler.is_compiling():
        raise_topk_entropy_errors(topk_entropy_invalid(out[0]), logits)
    return out


@_fake("topk_entropy")
def _(logits, k, parent_entropy=None):
    torch._check(logits.dim() == 2, lambda: "topk_entropy: logits must be [M, V]")
    torch._check(logits.dtype in FLOAT_LOGITS, lambda: "topk_entropy: logits must be float32/float16/bfloat16")
    torch._check(1 <= k, lambda: "topk_entropy: k must be >= 1")
    torch._check(k <= logits.size(1), lambda: "topk_entropy: k must be <= V")
    torch._check(k <= MAX_TOPK, lambda: f"topk_entropy: k must be <= {MAX_TOPK}")
    M = logits.size(0)
    return (
        logits.new_empty((M, k), dtype=torch.float32),
        logits.new_empty((M, k), dtype=_i64),
        logits.new_empty((M,), dtype=torch.float32),
    )


# ---------------------------------------------------------------------------------------------
# 3. entropy_bin_policy
# ---------------------------------------------------------------------------------------------
def entropy_bin_policy(
    path_entropy: Tensor, bin_edges: Tensor, bin_extra_depth: Tensor, bin_budget: Tensor
) -> Tuple[Tensor, Tensor, Tensor]:
    """Entropy bin of each request and that bin's action, in one launch.

    Parameters
    ----------
    path_entropy : Tensor
        ``[B]`` float32, ``H(P*)`` of each request.
    bin_edges : Tensor
        ``[nb - 1]`` float32, ascending (``nb`` bins; ``nb = 1`` means no edges).
    bin_extra_depth : Tensor
        ``[nb]`` int64, extra draft depth of each bin (DED).
    bin_budget : Tensor
        ``[nb]`` int64, Top-N node budget of each bin (TNP).

    Returns
    -------
    bins : Tensor
        ``[B]`` int64, the number of edges ``e`` with ``path_entropy > e`` (a value equal to an
        edge goes to the lower bin, CART's ``x <= s``). Bin 0 = lowest entropy; NaN goes to the
        last bin.
    extra_depth : Tensor
        ``[B]`` int64, ``bin_extra_depth[bins]``.
    budget : Tensor
        ``[B]`` int64, ``bin_budget[bins]``.
    """
    op = "entropy_bin_policy"
    check_tensor(op, "path_entropy", path_entropy, dtype=torch.float32, ndim=1, layout="[B]")
    dev = path_entropy.device
    check_tensor(op, "bin_edges", bin_edges, dtype=torch.float32, ndim=1, layout="[num_bins - 1]",
                 device=dev, device_of="path_entropy")
    nb = bin_edges.size(0) + 1
    for name, t in (("bin_extra_depth", bin_extra_depth), ("bin_budget", bin_budget)):
        check_tensor(op, name, t, dtype=_i64, ndim=1, layout="[num_bins]", device=dev, device_of="path_entropy")
        check_size(op, name, t, 0, nb, "num_bins = bin_edges.size(0) + 1")
    return _ops.entropy_bin_policy.default(path_entropy, bin_edges, bin_extra_depth, bin_budget)


@_fake("entropy_bin_policy")
def _(path_entropy, bin_edges, bin_extra_depth, bin_budget):
    torch._check(path_entropy.dim() == 1, lambda: "entropy_bin_policy: path_entropy must be [B]")
    torch._check(bin_extra_depth.size(0) == bin_edges.size(0) + 1, lambda: "entropy_bin_policy: bin sizes differ")
    torch._check(bin_budget.size(0) == bin_edges.size(0) + 1, lambda: "entropy_bin_policy: bin sizes differ")
    B = path_entropy.size(0)
    return tuple(path_entropy.new_empty((B,), dtype=_i64) for _ in range(3))


# ---------------------------------------------------------------------------------------------
# 2. select_tree_nodes
# ---------------------------------------------------------------------------------------------
def select_tree_nodes(
    scores: Tensor, parents: Tensor, budgets: Tensor, max_nodes: int
) -> Tuple[Tensor, Tensor, Tensor]:
    """Top-N pruning (EAGLE-2 rerank): the ``budgets[b]`` best draft candidates of each request.

    The effective score of a candidate is ``e[c] = min(scores[c], e[parents[c]])`` (root:
    ``+inf``); the selected set is the ``min(budgets[b], #valid)`` candidates with the largest
    ``e`` (ties: lower index), which is closed under ancestors. A candidate is valid when
    ``e[c] > -inf`` (its score and all its ancestors' scores are finite).

    Parameters
    ----------
    scores : Tensor
        ``[B, C]`` float32 cumulative log-scores; ``-inf`` = invalid / padding. NaN is an error.
    parents : Tensor
        ``[B, C]`` int64, parent candidate index in the same row, ``-1`` when the parent is the
        root; ``-1 <= parents[b, c] < c``.
    budgets : Tensor
        ``[B]`` int64, draft nodes to select (root not counted), ``0 <= budgets[b] <= max_nodes``.
    max_nodes : int
        ``>= 0``; the tree capacity is ``T = max_nodes + 1``.

    Returns
    -------
    tree_cand : Tensor
        ``[B, T]`` int64: position 0 = ``-1`` (root), positions ``1..n-1`` = selected candidate
        indices in ascending order (parents precede children), padding ``-1``.
    tree_parents : Tensor
        ``[B, T]`` int64: tree position of each node's parent (0 for children of the root),
        ``-1`` at position 0 and in the padding.
    num_nodes : Tensor
        ``[B]`` int64, ``1 +`` the number of selected candidates.
    """
    op = "select_tree_nodes"
    check_tensor(op, "scores", scores, dtype=torch.float32, ndim=2, layout="[B, C]")
    dev = scores.device
    check_tensor(op, "parents", parents, dtype=_i64, ndim=2, layout="[B, C]", device=dev, device_of="scores")
    check_size(op, "parents", parents, 0, scores.size(0), "B = scores.size(0)")
    check_size(op, "parents", parents, 1, scores.size(1), "C = scores.size(1)")
    _vec(op, "budgets", budgets, scores.size(0), dev, "scores")
    check_int(op, "max_nodes", max_nodes, minimum=0)
    return _ops.select_tree_nodes.default(scores, parents, budgets, max_nodes)


@_fake("select_tree_nodes")
def _(scores, parents, budgets, max_nodes):
    torch._check(scores.dim() == 2, lambda: "select_tree_nodes: scores must be [B, C]")
    torch._check(max_nodes >= 0, lambda: "select_tree_nodes: max_nodes must be >= 0")
    B = scores.size(0)
    T = max_nodes + 1
    return (
        scores.new_empty((B, T), dtype=_i64),
        scores.new_empty((B, T), dtype=_i64),
        scores.new_empty((B,), dtype=_i64),
    )


# ---------------------------------------------------------------------------------------------
# 4. build_tree
# ---------------------------------------------------------------------------------------------
def build_tree(
    tree_parents: Tensor, num_nodes: Tensor, prefix_lens: Tensor
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Ancestor mask, absolute positions and child / sibling links of a batch of trees.

    Parameters
    ----------
    tree_parents : Tensor
        ``[B, T]`` int64 as produced by :func:`select_tree_nodes`: ``tree_parents[b, 0] == -1``
        and ``0 <= tree_parents[b, i] < i`` for ``1 <= i < num_nodes[b]`` (validated); padding
        entries are ignored.
    num_nodes : Tensor
        ``[B]`` int64, ``1 <= num_nodes[b] <= T``.
    prefix_lens : Tensor
        ``[B]`` int64 ``>= 0``, committed tokens ``L_b`` (the root sits at position ``L_b``).

    Returns
    -------
    tree_mask : Tensor
        ``[B, T, T]`` bool, ``[b, i, j]`` = node ``j`` is ``i`` or an ancestor of ``i``. Padding
        rows ``i >= num_nodes[b]`` have only ``[b, i, i]`` set; real rows never see padding.
    positions : Tensor
        ``[B, T]`` int64, ``prefix_lens[b] + depth(i)``; padding ``prefix_lens[b]``.
    first_child : Tensor
        ``[B, T]`` int64, smallest position among ``i``'s children, ``-1`` if none / padding.
    next_sibling : Tensor
        ``[B, T]`` int64, next larger position with the same parent, ``-1`` if none / padding.
    """
    op = "build_tree"
    check_tensor(op, "tree_parents", tree_parents, dtype=_i64, ndim=2, layout="[B, T]")
    B = tree_parents.size(0)
    _vec(op, "num_nodes", num_nodes, B, tree_parents.device, "tree_parents")
    _vec(op, "prefix_lens", prefix_lens, B, tree_parents.device, "tree_parents")
    return _ops.build_tree.default(tree_parents, num_nodes, prefix_lens)


@_fake("build_tree")
def _(tree_parents, num_nodes, prefix_lens):
    torch._check(tree_parents.dim() == 2, lambda: "build_tree: tree_parents must be [B, T]")
    B, T = tree_parents.shape
    return (
        tree_parents.new_empty((B, T, T), dtype=torch.bool),
        tree_parents.new_empty((B, T), dtype=_i64),
        tree_parents.new_empty((B, T), dtype=_i64),
        tree_parents.new_empty((B, T), dtype=_i64),
    )


# ---------------------------------------------------------------------------------------------
# 5. tree_attention_mask
# ---------------------------------------------------------------------------------------------
def tree_attention_mask(
    tree_mask: Tensor, num_nodes: Tensor, prefix_lens: Tensor, mask_numel: int
) -> Tuple[Tensor, Tensor]:
    """FlashInfer ``custom_mask`` (flat, ragged over requests) for a prefill over prefix + tree.

    Parameters
    ----------
    tree_mask : Tensor
        ``[B, T, T]`` bool from :func:`build_tree`.
    num_nodes : Tensor
        ``[B]`` int64, ``n_b``, ``1 <= n_b <= T``.
    prefix_lens : Tensor
        ``[B]`` int64 ``L_b >= 0``.
    mask_numel : int
        Must equal ``sum_b n_b * (L_b + n_b)`` (passed in so that CUDA needs no host sync; a
        wrong value is an error, since FlashInfer would silently read garbage).

    Returns
    -------
    custom_mask : Tensor
        ``[mask_numel]`` bool, the concatenation over ``b`` of the row-major ``[n_b, L_b + n_b]``
        blocks: column ``c < L_b`` is True, column ``L_b + j`` is ``tree_mask[b, i, j]``.
        Pass it to FlashInfer's ``plan(..., custom_mask=...)`` by keyword (it packs the bits).
    mask_indptr : Tensor
        ``[B + 1]`` int64 element offsets of each block.
    """
    op = "tree_attention_mask"
    check_tensor(op, "tree_mask", tree_mask, dtype=torch.bool, ndim=3, layout="[B, T, T]")
    check_size(op, "tree_mask", tree_mask, 2, tree_mask.size(1), "T = tree_mask.size(1); the mask is square")
    B = tree_mask.size(0)
    _vec(op, "num_nodes", num_nodes, B, tree_mask.device, "tree_mask")
    _vec(op, "prefix_lens", prefix_lens, B, tree_mask.device, "tree_mask")
    check_int(op, "mask_numel", mask_numel, minimum=0)
    return _ops.tree_attention_mask.default(tree_mask, num_nodes, prefix_lens, mask_numel)


@_fake("tree_attention_mask")
def _(tree_mask, num_nodes, prefix_lens, mask_numel):
    torch._check(tree_mask.dim() == 3, lambda: "tree_attention_mask: tree_mask must be [B, T, T]")
    torch._check(mask_numel >= 0, lambda: "tree_attention_mask: mask_numel must be >= 0")
    B = tree_mask.size(0)
    return (
        tree_mask.new_empty((mask_numel,), dtype=torch.bool),
        tree_mask.new_empty((B + 1,), dtype=_i64),
    )


# ---------------------------------------------------------------------------------------------
# 6. dense_tree_attention_mask
# ---------------------------------------------------------------------------------------------
def dense_tree_attention_mask(tree_mask: Tensor, prefix_lens: Tensor, width: int) -> Tensor:
    """The tree attention mask padded to a static cache width (for ``scaled_dot_product_attention``).

    Parameters
    ----------
    tree_mask : Tensor
        ``[B, T, T]`` bool from :func:`build_tree`.
    prefix_lens : Tensor
        ``[B]`` int64 ``L_b >= 0`` with ``L_b + T <= width``.
    width : int
        Key length of the static cache.

    Returns
    -------
    Tensor
        ``[B, T, width]`` bool: row ``i`` of request ``b`` has columns ``< L_b`` True, column
        ``L_b + j`` (``j < T``) = ``tree_mask[b, i, j]``, all other columns False.
    """
    op = "dense_tree_attention_mask"
    check_tensor(op, "tree_mask", tree_mask, dtype=torch.bool, ndim=3, layout="[B, T, T]")
    check_size(op, "tree_mask", tree_mask, 2, tree_mask.size(1), "T = tree_mask.size(1); the mask is square")
    _vec(op, "prefix_lens", prefix_lens, tree_mask.size(0), tree_mask.device, "tree_mask")
    check_int(op, "width", width, minimum=0)
    return _ops.dense_tree_attention_mask.default(tree_mask, prefix_lens, width)


@_fake("dense_tree_attention_mask")
def _(tree_mask, prefix_lens, width):
    torch._check(tree_mask.dim() == 3, lambda: "dense_tree_attention_mask: tree_mask must be [B, T, T]")
    torch._check(width >= 0, lambda: "dense_tree_attention_mask: width must be >= 0")
    B, T = tree_mask.size(0), tree_mask.size(1)
    return tree_mask.new_empty((B, T, width), dtype=torch.bool)


# ---------------------------------------------------------------------------------------------
# 7. verify_greedy / 8. verify_sampling
# ---------------------------------------------------------------------------------------------
def _check_tree_args(op: str, tree_tokens: Tensor, first_child: Tensor, next_sibling: Tensor, num_nodes: Tensor):
    check_tensor(op, "tree_tokens", tree_tokens, dtype=_i64, ndim=2, layout="[B, T]")
    dev = tree_tokens.device
    B, T = tree_tokens.size(0), tree_tokens.size(1)
    for name, t in (("first_child", first_child), ("next_sibling", next_sibling)):
        check_tensor(op, name, t, dtype=_i64, ndim=2, layout="[B, T]", device=dev, device_of="tree_tokens")
        check_size(op, name, t, 0, B, "B = tree_tokens.size(0)")
        check_size(op, name, t, 1, T, "T = tree_tokens.size(1)")
    _vec(op, "num_nodes", num_nodes, B, dev, "tree_tokens")
    return B, T


def verify_greedy(
    tree_tokens: Tensor, target_ids: Tensor, first_child: Tensor, next_sibling: Tensor, num_nodes: Tensor
) -> Tuple[Tensor, Tensor, Tensor]:
    """Greedy verification: the longest tree path whose tokens match the target's argmax.

    From the root, at node ``cur`` scan its children in sibling order and accept the first whose
    token equals ``target_ids[b, cur]``; stop when none matches.

    Parameters
    ----------
    tree_tokens : Tensor
        ``[B, T]`` int64 token of each node (position 0 = the root token, not matched).
    target_ids : Tensor
        ``[B, T]`` int64, the target's argmax at each node (its prediction for the next token).
    first_child, next_sibling : Tensor
        ``[B, T]`` int64 links from :func:`build_tree` (``-1`` = none). Validated: each link is
        ``-1`` or a position in ``(i, num_nodes[b])``.
    num_nodes : Tensor
        ``[B]`` int64, ``1 <= num_nodes[b] <= T``.

    Returns
    -------
    accept_path : Tensor
        ``[B, T]`` int64 tree positions of the root (``0``) and the accepted nodes, ``-1`` padded.
    accept_len : Tensor
        ``[B]`` int64 accepted draft nodes (root and bonus not counted).
    bonus : Tensor
        ``[B]`` int64, ``target_ids[b, last accepted position]``. Emitted tokens this round =
        accepted drafts + bonus (``accept_len + 1``).
    """
    op = "verify_greedy"
    B, T = _check_tree_args(op, tree_tokens, first_child, next_sibling, num_nodes)
    check_tensor(op, "target_ids", target_ids, dtype=_i64, ndim=2, layout="[B, T]", device=tree_tokens.device,
                 device_of="tree_tokens")
    check_size(op, "target_ids", target_ids, 0, B, "B = tree_tokens.size(0)")
    check_size(op, "target_ids", target_ids, 1, T, "T = tree_tokens.size(1)")
    return _ops.verify_greedy.default(tree_tokens, target_ids, first_child, next_sibling, num_nodes)


def _fake_verify(tree_tokens):
    torch._check(tree_tokens.dim() == 2, lambda: "verify: tree_tokens must be [B, T]")
    B, T = tree_tokens.shape
    return (
        tree_tokens.new_empty((B, T), dtype=_i64),
        tree_tokens.new_empty((B,), dtype=_i64),
        tree_tokens.new_empty((B,), dtype=_i64),
    )


@_fake("verify_greedy")
def _(tree_tokens, target_ids, first_child, next_sibling, num_nodes):
    return _fake_verify(tree_tokens)


def verify_sampling(
    tree_tokens: Tensor,
    target_probs: Tensor,
    first_child: Tensor,
    next_sibling: Tensor,
    num_nodes: Tensor,
    coins: Optional[Tensor] = None,
    final_coins: Optional[Tensor] = None,
    *,
    generator: Optional[torch.Generator] = None,
    check_valid: bool = False,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Lossless multi-candidate rejection sampling over a tree of one-hot (top-k) drafts.

    At node ``cur`` with children ``c_1..c_m`` (sibling order; a child repeating an earlier
    sibling's token is skipped), with ``u = coins[b, cur]`` and the running sum
    ``S += p(x_j)`` of the normalised target probabilities, accept the first child with
    ``u < S`` and descend. If none is accepted, the bonus is drawn from ``p`` with the children's
    tokens zeroed (renormalised) by inverse CDF with ``final_coins[b]``; at a leaf, from the full
    ``p``. Emitted tokens are distributed exactly as the target's sampling distribution.

    Parameters
    ----------
    tree_tokens : Tensor
        ``[B, T]`` int64 node tokens (position 0 = root, not used); real non-root tokens must be
        in ``[0, V)``.
    target_probs : Tensor
        ``[B, T, V]`` float32 ``>= 0``, the target's processed distribution at each node
        (temperature / top-k / top-p already applied); rows are normalised internally. Every row
        the walk reads must be finite with positive mass (CPU raises ``ValueError`` otherwise).
    first_child, next_sibling : Tensor
        ``[B, T]`` int64 links from :func:`build_tree`.
    num_nodes : Tensor
        ``[B]`` int64, ``1 <= num_nodes[b] <= T``.
    coins : Tensor, optional
        ``[B, T]`` float32 uniforms in ``[0, 1)``; ``coins[b, i]`` decides among the children of
        node ``i``. Drawn with ``torch.rand(generator=generator)`` when ``None``.
    final_coins : Tensor, optional
        ``[B]`` float32 uniforms in ``[0, 1)`` that sample the bonus. Drawn when ``None``.
    generator : torch.Generator, optional
        Used only to draw missing coins.

    check_valid : bool
        CUDA only flags a request whose walk reached an invalid row (see Notes); with ``True``
        the wrapper raises the CPU op's ``ValueError`` on it (one device sync). CPU always raises.

    Returns
    -------
    accept_path, accept_len, bonus : Tensor
        As in :func:`verify_greedy`; ``bonus`` is the sampled extra token, or ``-1`` on CUDA for
        a request whose walk reached an invalid row (see Notes).

    Raises
    ------
    ValueError
        Bad dtype / rank / device / sizes, or (CPU, or CUDA with ``check_valid``) a coin outside
        ``[0, 1)``, a token outside ``[0, V)``, a bad tree link, or a ``target_probs`` row the walk
        reads that is not a distribution: ``verify_sampling: target_probs[b, i] is not a valid
        distribution (a negative, NaN or inf entry, or all zeros)``.

    Notes
    -----
    Invalid rows on CUDA (no host sync): when the walk of request ``b`` reaches a node ``i`` whose
    ``target_probs`` row has a negative, NaN or ``inf`` entry or no mass, it stops there with
    ``bonus[b] = -1`` and ``accept_path[b, accept_len[b]] = i`` (``i`` and the nodes accepted
    before it stay in the path, ``-1`` after). ``bonus = -1`` is not a token: do not embed it (clamp it, or check
    first). :func:`verify_sampling_invalid` turns the outputs into a ``[B]`` int64 flag (``-1`` =
    valid, else ``i``) without a sync: pack it into the round's one device-to-host read and call
    :func:`raise_verify_sampling_errors`, which raises the CPU op's ``ValueError``. Other values
    the CPU op rejects (coins, tokens, links) are not flagged on CUDA: the walk stays memory-safe
    (links followed only forward below ``num_nodes``, an out-of-range token has probability 0).
    """
    op = "verify_sampling"
    B, T = _check_tree_args(op, tree_tokens, first_child, next_sibling, num_nodes)
    dev = tree_tokens.device
    check_tensor(op, "target_probs", target_probs, dtype=torch.float32, ndim=3, layout="[B, T, V]", device=dev,
                 device_of="tree_tokens")
    check_size(op, "target_probs", target_probs, 0, B, "B = tree_tokens.size(0)")
    check_size(op, "target_probs", target_probs, 1, T, "T = tree_tokens.size(1)")
    if coins is None:
        coins = torch.rand((B, T), generator=generator, device=dev, dtype=torch.float32)
    if final_coins is None:
        final_coins = torch.rand((B,), generator=generator, device=dev, dtype=torch.float32)
    check_tensor(op, "coins", coins, dtype=torch.float32, ndim=2, layout="[B, T]", device=dev,
                 device_of="tree_tokens")
    check_size(op, "coins", coins, 0, B, "B = tree_tokens.size(0)")
    check_size(op, "coins", coins, 1, T, "T = tree_tokens.size(1)")
    check_tensor(op, "final_coins", final_coins, dtype=torch.float32, ndim=1, layout="[B]", device=dev,
                 device_of="tree_tokens")
    check_size(op, "final_coins", final_coins, 0, B, "B = tree_tokens.size(0)")
    out = _ops.verify_sampling.default(tree_tokens, target_probs, first_child, next_sibling, num_nodes, coins,
                                       final_coins)
    if check_valid and not torch.compiler.is_compiling():
        raise_verify_sampling_errors(verify_sampling_invalid(*out))
    return out


@_fake("verify_sampling")
def _(tree_tokens, target_probs, first_child, next_sibling, num_nodes, coins, final_coins):
    torch._check(target_probs.dim() == 3, lambda: "verify_sampling: target_probs must be [B, T, V]")
    return _fake_verify(tree_tokens)


# ---------------------------------------------------------------------------------------------
# 9. compact_kv_
# ---------------------------------------------------------------------------------------------
def compact_kv_(
    k_cache: Tensor, v_cache: Tensor, accept_path: Tensor, accept_len: Tensor, prefix_lens: Tensor
) -> None:
    """Move each request's accepted K/V rows to the end of its committed prefix, in place.

    For every layer ``l``, request ``b`` and ``i in [0, accept_len[b]]``:
    ``cache[l, b, L_b + i] = cache[l, b, L_b + accept_path[b, i]]`` (read-before-write).

    Parameters
    ----------
    k_cache, v_cache : Tensor
        ``[num_layers, B, S, H_kv, D]``, same shape / dtype / device, contiguous, not overlapping;
        written in place.
    accept_path : Tensor
        ``[B, P]`` int64 (``P >= 1``, usually ``T``) from :func:`verify_greedy` /
        :func:`verify_sampling`. Validated: ``accept_path[b, 0] == 0``, strictly increasing over
        ``[0, accept_len[b]]``, and ``L_b + accept_path[b, accept_len[b]] < S``.
    accept_len : Tensor
        ``[B]`` int64, ``0 <= accept_len[b] < P``.
    prefix_lens : Tensor
        ``[B]`` int64, ``0 <= L_b < S``.
    """
    op = "compact_kv_"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, t, ndim=5, layout="[num_layers, B, S, H_kv, D]")
    dev = k_cache.device
    check_tensor(op, "v_cache", v_cache, dtype=k_cache.dtype, device=dev, device_of="k_cache")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{op}: expected v_cache of the same shape as k_cache {list(k_cache.shape)}, got {list(v_cache.shape)}"
        )
    B = k_cache.size(1)
    check_tensor(op, "accept_path", accept_path, dtype=_i64, ndim=2, layout="[B, P]", device=dev,
                 device_of="k_cache")
    check_size(op, "accept_path", accept_path, 0, B, "B = k_cache.size(1)")
    _vec(op, "accept_len", accept_len, B, dev, "k_cache")
    _vec(op, "prefix_lens", prefix_lens, B, dev, "k_cache")
    _ops.compact_kv_.default(k_cache, v_cache, accept_path, accept_len, prefix_lens)


@_fake("compact_kv_")
def _(k_cache, v_cache, accept_path, accept_len, prefix_lens):
    torch._check(k_cache.dim() == 5, lambda: "compact_kv_: k_cache must be [num_layers, B, S, H_kv, D]")
    return None


# ---------------------------------------------------------------------------------------------
# 10. stream_linear_pack / stream_linear (CPU)
# ---------------------------------------------------------------------------------------------
def _cpu_only(op: str, name: str, x: Tensor, on_gpu: str = "torch.nn.functional.linear") -> None:
    if x.device.type != "cpu":
        raise ValueError(f"{op}: expected {name} on the CPU, got {x.device} (a CPU kernel: on a GPU use "
                         f"{on_gpu})")


def stream_linear_pack(weight: Tensor) -> Tensor:
    """Pack a linear layer's weight once for :func:`stream_linear` (CPU, float32, bfloat16 or float16).

    Parameters
    ----------
    weight : Tensor
        ``[N, K]`` float32, bfloat16 or float16 on the CPU (``nn.Linear.weight``: out_features x
        in_features). A float32 weight whose values are all float16 values packs as float16 with
        the same results from half the bytes (``weight.half()``; float32 inputs).

    Returns
    -------
    Tensor
        ``[P, K, 32]`` of ``weight``'s dtype, ``P = ceil(N / 32)``: block ``p`` holds outputs
        ``32p .. 32p + 31`` with, for each input index ``k``, their 32 weights contiguous (outputs
        past ``N`` are 0).
    """
    op = "stream_linear_pack"
    check_tensor(op, "weight", weight, dtype=STREAM_WEIGHT_DTYPES, ndim=2, layout="[N, K]")
    _cpu_only(op, "weight", weight)
    return _ops.stream_linear_pack.default(weight)


@_fake("stream_linear_pack")
def _(weight):
    torch._check(weight.dim() == 2, lambda: "stream_linear_pack: weight must be [N, K]")
    N, K = weight.shape
    return weight.new_empty(((N + STREAM_BLOCK - 1) // STREAM_BLOCK, K, STREAM_BLOCK))


def stream_linear(x: Tensor, packed_weight: Tensor, bias: Optional[Tensor], out_features: int) -> Tensor:
    """``x @ weight.T + bias`` for the few rows of a tree verify, streaming each weight once (CPU).

    Every output is one chain of fused multiply-adds over ``k`` in order, in float32, so a row's
    result does not depend on the other rows of the call (a tree verify gives each token the values
    a one-token step would). bfloat16 weights stream half the bytes: they widen exactly to float32
    in registers; a bfloat16 result is the float32 one (bias included) rounded once. float16
    weights with a float32 ``x`` also widen exactly: the float32 result of the same values.

    Parameters
    ----------
    x : Tensor
        ``[..., K]`` float32 or bfloat16 on the CPU.
    packed_weight : Tensor
        ``[P, K, 32]`` of ``x``'s dtype (or float16 with a float32 ``x``), from
        :func:`stream_linear_pack`.
    bias : Tensor, optional
        ``[N]`` of ``x``'s dtype, or None.
    out_features : int
        ``N``, with ``32 (P - 1) < N <= 32 P``.

    Returns
    -------
    Tensor
        ``[..., N]`` of ``x``'s dtype.
    """
    op = "stream_linear"
    check_tensor(op, "x", x, dtype=STREAM_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"{op}: expected x to have at least 1 dimension [..., K], got a 0-dimensional tensor")
    _cpu_only(op, "x", x)
    half_weights = x.dtype == torch.float32 and isinstance(packed_weight, Tensor) and packed_weight.dtype == torch.float16
    check_tensor(op, "packed_weight", packed_weight, dtype=torch.float16 if half_weights else x.dtype, ndim=3,
                 layout="[P, K, 32] from stream_linear_pack", device=x.device, device_of="x")
    if bias is not None:
        check_tensor(op, "bias", bias, dtype=x.dtype, ndim=1, layout="[N]", device=x.device, device_of="x")
    check_int(op, "out_features", out_features, minimum=0)
    return _ops.stream_linear.default(x, packed_weight, bias, out_features)


@_fake("stream_linear")
def _(x, packed_weight, bias, out_features):
    torch._check(packed_weight.dim() == 3, lambda: "stream_linear: packed_weight must be [P, K, 32]")
    return x.new_empty((*x.shape[:-1], out_features))


#: Inputs per scale group of :func:`stream_linear_blocks` (a GGUF Q4_1 / Q8_0 block).
STREAM_GROUP = 32

#: Code formats :func:`stream_linear_pack_blocks` recognises, most compact first: name -> codes dtype.
BLOCK_FORMATS = {"q4_1": torch.uint8, "q8_0": torch.int8}


def _blocks_of(w: Tensor, fmt: str) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
    """(q [N, G, 32] int, d [N, G], m [N, G]) float32 with ``fma(q, d, m) == w`` exactly for every
    weight of ``w`` [N, K] (G = K / 32 groups of one output's inputs), d and m float16 values; None
    where some group has no such codes. The quantiser's own choice is recovered: Q4_1 stores
    m = min and d = (max - min) / 15 (so the group's minimum has q = 0, its maximum q = 15), Q8_0
    d = absmax / 127; d is tried at its float16 rounding and the two neighbours."""
    N, K = w.shape
    g = w.reshape(N, K // STREAM_GROUP, STREAM_GROUP)
    if fmt == "q4_1":
        lo, hi, qmax = g.amin(-1), g.amax(-1), 15.0
        m = lo.half().float()
        if not torch.equal(m, lo):
            return None
        d0 = ((hi - m) / qmax).half()
    else:
        lo, qmax = None, 127.0
        m = torch.zeros(g.shape[:2])
        d0 = (g.abs().amax(-1) / qmax).half()
    ok = torch.zeros(g.shape[:2], dtype=torch.bool)
    q_best = torch.zeros_like(g)
    d_best = torch.zeros(g.shape[:2])
    inf = torch.tensor(float("inf"), dtype=torch.float16)
    for d16 in (d0, torch.nextafter(d0, inf), torch.nextafter(d0, -inf)):
        d = d16.float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = ((g - m[..., None]) / safe[..., None]).round()
        q = q.clamp(0, 15) if fmt == "q4_1" else q.clamp(-128, 127)
        q = torch.where((d > 0)[..., None], q, torch.zeros_like(q))
        # fma(q, d, m) == d * q + m rounded once: d * q is exact in float32 (11-bit by 8-bit)
        good = ((d[..., None] * q).double() + m[..., None].double()).float().eq(g).all(-1) & ~ok
        q_best[good], d_best[good] = q[good], d[good]
        ok |= good
        if bool(ok.all()):
            return q_best, d_best, m
    return None


def stream_linear_pack_blocks(weight: Tensor, formats: Sequence[str] = tuple(BLOCK_FORMATS)
                              ) -> Optional[Tuple[str, Tensor, Tensor]]:
    """The codes of a float32 weight that holds a block-quantised file's values exactly, packed for
    :func:`stream_linear_blocks`; None when it holds no such values (checked for every weight).

    A model converted from a GGUF Q4_1 / Q8_0 file (the built-in SmolLM2 target) keeps the
    dequantised values ``d * q + m`` in float32: 4 or 8 bits of information in 32. Streaming the
    codes instead of the floats reads 5-6x fewer bytes per step and computes the same outputs bit
    for bit (:func:`stream_linear_blocks`).

    Parameters
    ----------
    weight : Tensor
        ``[N, K]`` float32 on the CPU, ``K`` a multiple of 32.
    formats : sequence of str
        Formats to try, in order (default: ``"q4_1"``, then ``"q8_0"``).

    Returns
    -------
    (str, Tensor, Tensor) or None
        ``(format, codes, scales)``: codes ``[P, K, 16]`` uint8 (Q4_1: byte ``j`` of input ``k``
        holds output ``32p + j`` in its low nibble and ``32p + 16 + j`` in its high one) or
        ``[P, K, 32]`` int8 (Q8_0), scales ``[P, K / 32, 2, 32]`` float32 (d, then m, of each
        output per group of 32 inputs), ``P = ceil(N / 32)``; outputs past ``N`` have codes and
        scales 0.
    """
    op = "stream_linear_pack_blocks"
    check_tensor(op, "weight", weight, dtype=(torch.float32,), ndim=2, layout="[N, K]")
    _cpu_only(op, "weight", weight)
    bad = [f for f in formats if f not in BLOCK_FORMATS]
    if bad:
        raise ValueError(f"{op}: unknown format {bad[0]!r}; expected one of {sorted(BLOCK_FORMATS)}")
    N, K = weight.shape
    if K % STREAM_GROUP or N == 0 or K == 0 or not bool(torch.isfinite(weight).all()):
        return None
    w = weight.detach()
    for fmt in formats:
        # the first few outputs first: a trained or random weight fails there at once
        if N > 64 and _blocks_of(w[:64], fmt) is None:
            continue
        found = _blocks_of(w, fmt)
        if found is None:
            continue
        q, d, m = found
        P = (N + STREAM_BLOCK - 1) // STREAM_BLOCK
        pad = P * STREAM_BLOCK - N
        q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, pad)).reshape(P, STREAM_BLOCK, K)   # [P, 32, K]
        q = q.transpose(1, 2)                                                            # [P, K, 32]
        if fmt == "q4_1":
            q = q.to(torch.uint8)
            codes = (q[..., :16] | (q[..., 16:] << 4)).contiguous()
        else:
            codes = q.to(torch.int8).contiguous()
        dm = torch.stack((d, m), 0)                                        # [2, N, G]
        dm = torch.nn.functional.pad(dm, (0, 0, 0, pad)).reshape(2, P, STREAM_BLOCK, K // STREAM_GROUP)
        scales = dm.permute(1, 3, 0, 2).contiguous()                       # [P, G, 2, 32]
        return fmt, codes, scales
    return None


def stream_linear_blocks(x: Tensor, codes: Tensor, scales: Tensor, bias: Optional[Tensor],
                         out_features: int) -> Tensor:
    """:func:`stream_linear` for a float32 weight streamed as its block codes (CPU).

    Each code widens in registers to the float32 weight ``fma(q, d, m)`` exactly and joins the same
    FMA chain, so the result equals :func:`stream_linear` on the float32 weight bit for bit (and is
    row-invariant like it), reading 4 (Q4_1) or 8 (Q8_0) bits per weight instead of 32.

    A bfloat16 ``x`` takes the weight in bfloat16: each widened weight is rounded to bfloat16 (to
    nearest even, as ``weight.to(torch.bfloat16)``) before the same float32 chain, and the result
    is rounded once, so it equals :func:`stream_linear` on that bfloat16 weight bit for bit, from 4
    or 8 bits a weight instead of 16.

    Parameters
    ----------
    x : Tensor
        ``[..., K]`` float32 or bfloat16 on the CPU.
    codes, scales : Tensor
        From :func:`stream_linear_pack_blocks`: ``[P, K, 16]`` uint8 (Q4_1) or ``[P, K, 32]`` int8
        (Q8_0), and ``[P, K / 32, 2, 32]`` float32.
    bias : Tensor, optional
        ``[N]`` of ``x``'s dtype, or None.
    out_features : int
        ``N``, with ``32 (P - 1) < N <= 32 P``.

    Returns
    -------
    Tensor
        ``[..., N]`` of ``x``'s dtype.
    """
    op = "stream_linear_blocks"
    check_tensor(op, "x", x, dtype=(torch.float32, torch.bfloat16))
    if x.dim() < 1:
        raise ValueError(f"{op}: expected x to have at least 1 dimension [..., K], got a 0-dimensional tensor")
    _cpu_only(op, "x", x)
    check_tensor(op, "codes", codes, dtype=tuple(BLOCK_FORMATS.values()), ndim=3,
                 layout="[P, K, 16] uint8 (Q4_1) or [P, K, 32] int8 (Q8_0)", device=x.device, device_of="x")
    check_tensor(op, "scales", scales, dtype=(torch.float32,), ndim=4, layout="[P, K / 32, 2, 32]",
                 device=x.device, device_of="x")
    if bias is not None:
        check_tensor(op, "bias", bias, dtype=(x.dtype,), ndim=1, layout="[N]", device=x.device, device_of="x")
    check_int(op, "out_features", out_features, minimum=0)
    return _ops.stream_linear_blocks.default(x, codes, scales, bias, out_features)


@_fake("stream_linear_blocks")
def _(x, codes, scales, bias, out_features):
    torch._check(codes.dim() == 3, lambda: "stream_linear_blocks: codes must be [P, K, 16] or [P, K, 32]")
    return x.new_empty((*x.shape[:-1], out_features))


# ---------------------------------------------------------------------------------------------
# 11. rms_norm / rope / rope_kv_write_ (CPU): a decoder layer's glue
# ---------------------------------------------------------------------------------------------
_GLUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama RMSNorm of each row in one call (CPU): ``weight * (x32 / sqrt(mean(x32**2) + eps))``.

    ``x32`` is ``x`` in float32; the normalised row is cast back to ``x``'s dtype before the
    weight multiplies it (HF Llama's rounding; no cast in float32). The sum of squares runs in
    double in index order, one row at a time, so a row's result does not depend on the other rows.

    Parameters
    ----------
    x : Tensor
        ``[..., H]`` float32, float16 or bfloat16 on the CPU; any strides.
    weight : Tensor
        ``[H]``, ``x``'s dtype.
    eps : float
        Finite, ``>= 0``.

    Returns
    -------
    Tensor
        ``[..., H]``, ``x``'s dtype, contiguous.
    """
    op = "rms_norm"
    check_tensor(op, "x", x, dtype=_GLUE_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"{op}: expected x to have at least 1 dimension [..., H], got a 0-dimensional tensor")
    _cpu_only(op, "x", x, "the model's own RMSNorm")
    check_tensor(op, "weight", weight, dtype=x.dtype, ndim=1, layout="[H]", device=x.device, device_of="x")
    check_size(op, "weight", weight, 0, x.shape[-1], "H = x.size(-1)")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: expected a finite eps >= 0, got {eps!r}")
    return _ops.rms_norm.default(x, weight, float(eps))


@_fake("rms_norm")
def _(x, weight, eps):
    torch._check(weight.dim() == 1, lambda: "rms_norm: weight must be [H]")
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """Rotate-half RoPE of queries and keys in one call (CPU): ``x * cos + rotate_half(x) * sin``.

    ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``. Each product and the sum are rounded
    to the dtype as the three PyTorch elementwise ops round them (bit for bit the formula, no
    fused multiply-add).

    Parameters
    ----------
    q : Tensor
        ``[B, T, Hq, D]`` float32, float16 or bfloat16 on the CPU, ``D`` even; any strides.
    k : Tensor
        ``[B, T, Hk, D]``, ``q``'s dtype.
    cos : Tensor
        ``[B, T, D]``, ``q``'s dtype: the cosines of each token's position (scaled as the rope
        type asks; ``heterospec.models.layers.Rotary`` computes them).
    sin : Tensor
        ``[B, T, D]``, the sines.

    Returns
    -------
    q_out : Tensor
        ``[B, T, Hq, D]`` contiguous.
    k_out : Tensor
        ``[B, T, Hk, D]`` contiguous.
    """
    op = "rope"
    check_tensor(op, "q", q, dtype=_GLUE_DTYPES, ndim=4, layout="[B, T, Hq, D]")
    _cpu_only(op, "q", q, "heterospec.models.layers.apply_rope")
    if q.shape[3] % 2:
        raise ValueError(f"{op}: expected an even head size D = q.size(3) (rotate-half RoPE), got {q.shape[3]}")
    B, T, _, D = q.shape
    check_tensor(op, "k", k, dtype=q.dtype, ndim=4, layout="[B, T, Hk, D]", device=q.device, device_of="q")
    for d, n, what in ((0, B, "B = q.size(0)"), (1, T, "T = q.size(1)"), (3, D, "D = q.size(3)")):
        check_size(op, "k", k, d, n, what)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(op, name, t, dtype=q.dtype, ndim=3, layout="[B, T, D]", device=q.device, device_of="q")
        for d, n, what in ((0, B, "B = q.size(0)"), (1, T, "T = q.size(1)"), (2, D, "D = q.size(3)")):
            check_size(op, name, t, d, n, what)
    return _ops.rope.default(q, k, cos, sin)


@_fake("rope")
def _(q, k, cos, sin):
    torch._check(q.dim() == 4 and k.dim() == 4, lambda: "rope: q and k must be [B, T, H, D]")
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device))


def rope_kv_write_(qkv: Tensor, cos: Tensor, sin: Tensor, prefix_lens: Tensor, q_out: Tensor, k_cache: Tensor,
                   v_cache: Tensor) -> None:
    """A fused QKV projection's output to attention's inputs in one call (CPU): :func:`rope` of
    the queries into ``q_out``, of the keys into the cache, and the values into the cache.

    Per token, ``qkv`` holds ``Hq = q_out.size(2)`` query heads, then ``Hkv = k_cache.size(2)``
    key heads, then ``Hkv`` value heads, ``D`` values each (a fused Q/K/V projection's output).
    Writes ``q_out[b, t] = rope(q)[b, t]``, ``k_cache[b, prefix_lens[b] + t] = rope(k)[b, t]``
    and ``v_cache[b, prefix_lens[b] + t] = v[b, t]`` for every ``t < T``, with :func:`rope`'s
    arithmetic (the same bits). One call for what a decoder layer's Python did in about ten.

    Parameters
    ----------
    qkv : Tensor
        ``[B, T, (Hq + 2 * Hkv) * D]`` float32, float16 or bfloat16 on the CPU, last dimension
        contiguous.
    cos, sin : Tensor
        ``[B, T, D]``, ``qkv``'s dtype (as :func:`rope`).
    prefix_lens : Tensor
        ``[B]`` int64, ``0 <= prefix_lens[b]`` and ``prefix_lens[b] + T <= S``.
    q_out : Tensor
        ``[B, T, Hq, D]`` contiguous, ``qkv``'s dtype, ``D`` even; written.
    k_cache, v_cache : Tensor
        ``[B, S, Hkv, D]``, ``qkv``'s dtype, rows of ``D`` contiguous (one layer of
        :class:`heterospec.models.kv_cache.KVCache`); written at the ``T`` slots after each prefix.
    """
    op = "rope_kv_write_"
    check_tensor(op, "qkv", qkv, dtype=_GLUE_DTYPES, ndim=3, layout="[B, T, (Hq + 2 Hkv) * D]")
    _cpu_only(op, "qkv", qkv, "heterospec.models.layers.apply_rope and KVCache.write")
    B, T = qkv.shape[:2]
    check_tensor(op, "q_out", q_out, dtype=qkv.dtype, ndim=4, layout="[B, T, Hq, D]", device=qkv.device,
                 device_of="qkv")
    for d, n, what in ((0, B, "B = qkv.size(0)"), (1, T, "T = qkv.size(1)")):
        check_size(op, "q_out", q_out, d, n, what)
    if not q_out.is_contiguous():
        raise ValueError(f"{op}: expected q_out to be contiguous")
    D = q_out.shape[3]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, c, dtype=qkv.dtype, ndim=4, layout="[B, S, Hkv, D]", device=qkv.device,
                     device_of="qkv")
        check_size(op, name, c, 0, B, "B = qkv.size(0)")
        check_size(op, name, c, 3, D, "D = q_out.size(3)")
    for d, what in ((1, "S = k_cache.size(1)"), (2, "Hkv = k_cache.size(2)")):
        check_size(op, "v_cache", v_cache, d, k_cache.shape[d], what)
    if D % 2:
        raise ValueError(f"{op}: expected an even head size D = q_out.size(3) (rotate-half RoPE), got {D}")
    check_size(op, "qkv", qkv, 2, (q_out.shape[2] + 2 * k_cache.shape[2]) * D,
               "(Hq + 2 Hkv) * D = (q_out.size(2) + 2 k_cache.size(2)) * D")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(op, name, t, dtype=qkv.dtype, ndim=3, layout="[B, T, D]", device=qkv.device, device_of="qkv")
        for d, n, what in ((0, B, "B = qkv.size(0)"), (1, T, "T = qkv.size(1)"), (2, D, "D = q_out.size(3)")):
            check_size(op, name, t, d, n, what)
    check_tensor(op, "prefix_lens", prefix_lens, dtype=torch.int64, ndim=1, layout="[B]", device=qkv.device,
                 device_of="qkv")
    check_size(op, "prefix_lens", prefix_lens, 0, B, "B = qkv.size(0)")
    _ops.rope_kv_write_.default(qkv, cos, sin, prefix_lens, q_out, k_cache, v_cache)


@_fake("rope_kv_write_")
def _(qkv, cos, sin, prefix_lens, q_out, k_cache, v_cache):
    torch._check(qkv.dim() == 3 and q_out.dim() == 4,
                 lambda: "rope_kv_write_: qkv must be [B, T, N] and q_out [B, T, H, D]")
    return None


# ---------------------------------------------------------------------------------------------
# 12. tree_attention (CPU): a few query rows against each request's prefix and tree
# ---------------------------------------------------------------------------------------------
def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, prefix_lens: Tensor, tree_mask: Tensor,
                   scale: float) -> Tensor:
    """Attention of a decode step's or a tree verify's query rows over the KV cache (CPU).

    Query row ``(b, t, h)`` attends to cache slots ``s < prefix_lens[b]`` (the committed prefix)
    and to slots ``prefix_lens[b] + j`` where ``tree_mask[b, t, j]`` (its ancestors and itself,
    whose K/V the caller has written there; the ``C`` tree columns may outnumber the ``T`` query
    rows: a draft step's new nodes attend to the nodes of earlier steps too), with KV head ``h // (Hq // Hkv)`` (GQA): the
    ``sdpa`` of :func:`dense_tree_attention_mask`'s mask, without the mask. Only the visible
    slots are read. A row's result depends only on its query and the keys and values it sees,
    in slot order (not on the other rows, the batch or the threads), so a tree node gets what a
    one-token step gives the same token. float16 / bfloat16 run in float32, rounded once: their K/V
    are widened as they are read (exactly), so the result is the float32 call's on the widened
    tensors, without a float32 copy of the cache.

    Parameters
    ----------
    q : Tensor
        ``[B, T, Hq, D]`` float32, float16 or bfloat16 on the CPU; any strides.
    k_cache, v_cache : Tensor
        ``[B, S, Hkv, D]``, ``q``'s dtype, ``Hq`` a multiple of ``Hkv`` (a layer of
        :class:`heterospec.models.kv_cache.KVCache`).
    prefix_lens : Tensor
        ``[B]`` int64, ``0 <= prefix_lens[b]`` and ``prefix_lens[b] + C <= S``.
    tree_mask : Tensor
        ``[B, T, C]`` bool: query row ``t`` sees tree column ``j`` (slot ``prefix_lens[b] + j``).
        ``C = T`` for a verify (:func:`build_tree`'s ancestor mask; lower-triangular for a
        sequence).
        A row must see some key: a request with ``prefix_lens[b] == 0`` needs a True in every row.
    scale : float
        Finite; the scores are ``scale * (q . k)`` (usually ``D ** -0.5``).

    Returns
    -------
    Tensor
        ``[B, T, Hq, D]``, ``q``'s dtype, contiguous.
    """
    op = "tree_attention"
    check_tensor(op, "q", q, dtype=_GLUE_DTYPES, ndim=4, layout="[B, T, Hq, D]")
    _cpu_only(op, "q", q, "heterospec.models.layers.sdpa with dense_tree_attention_mask, or FlashInfer")
    B, T, Hq, D = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, t, dtype=q.dtype, ndim=4, layout="[B, S, Hkv, D]", device=q.device, device_of="q")
        for d, n, what in ((0, B, "B = q.size(0)"), (3, D, "D = q.size(3)")):
            check_size(op, name, t, d, n, what)
    check_size(op, "v_cache", v_cache, 1, k_cache.shape[1], "S = k_cache.size(1)")
    check_size(op, "v_cache", v_cache, 2, k_cache.shape[2], "Hkv = k_cache.size(2)")
    Hkv = k_cache.shape[2]
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"{op}: expected the query heads Hq = q.size(2) to be a multiple of the KV heads "
                         f"Hkv = k_cache.size(2), got Hq = {Hq}, Hkv = {Hkv}")
    _vec(op, "prefix_lens", prefix_lens, B, q.device, "q")
    check_tensor(op, "tree_mask", tree_mask, dtype=torch.bool, ndim=3, layout="[B, T, C]", device=q.device,
                 device_of="q")
    for d, n, what in ((0, B, "B = q.size(0)"), (1, T, "T = q.size(1)")):
        check_size(op, "tree_mask", tree_mask, d, n, what)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"{op}: expected a finite scale, got {scale!r}")
    return _ops.tree_attention.default(q, k_cache, v_cache, prefix_lens, tree_mask, float(scale))


@_fake("tree_attention")
def _(q, k_cache, v_cache, prefix_lens, tree_mask, scale):
    torch._check(q.dim() == 4, lambda: "tree_attention: q must be [B, T, Hq, D]")
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


# ---------------------------------------------------------------------------------------------
# 13. decoder_layer_ (CPU): a Llama decoder layer's kernels chained in C++
# ---------------------------------------------------------------------------------------------
def decoder_layer_(x: Tensor, norm1: Optional[Tensor], eps1: float, norm2: Tensor, eps2: float,
                   linears: Sequence[Tensor], out_features: Sequence[int], cos: Tensor, sin: Tensor,
                   prefix_lens: Tensor, tree_mask: Tensor, scale: float, x_out: Tensor, k_cache: Tensor,
                   v_cache: Tensor, residual: Optional[Tensor] = None) -> None:
    """One Llama decoder layer of a decode step or a tree verify (CPU), its kernels called from C++:
    a target's layer, or the EAGLE-3 draft's (no ``norm1``, its own ``residual``).

    With ``lin_i(t)`` the ``i``-th streamed linear call (:func:`stream_linear` of ``linears[2 i]``
    where ``linears[2 i + 1]`` has no elements, else :func:`stream_linear_blocks` of the codes
    ``linears[2 i]`` and scales ``linears[2 i + 1]``, no bias, ``out_features[i]`` outputs), and
    QKV, gate/up the layer's fused calls or their members' outputs concatenated::

        h  = rms_norm(x, norm1, eps1) if norm1 is given, else x
        q  = rope_kv_write_(QKV(h), cos, sin, prefix_lens + C - T, k_cache, v_cache)
        x1 = (residual if given, else x) + O(tree_attention(q, k_cache, v_cache, prefix_lens, tree_mask, scale))
        g, u = gate/up(rms_norm(x1, norm2, eps2))
        x_out = x1 + down(silu(g) * u)

    The same kernels in the same order as the Python layers (``models.target.StreamedLayer``,
    the draft's ``models.draft.Eagle3Draft._streamed_layer``), so the same bits, without a Python
    round trip per kernel. A linear's outputs are the same
    bits fused or not (each output column is its own dot product), so the layer takes whichever
    calls the tuned linears chose at this row count.

    Parameters
    ----------
    x : Tensor
        ``[B, T, Hin]`` float32 (or bfloat16 with float / bfloat16 stream weights) on the CPU: the
        layer's input (``Hin = H`` without ``residual``).
    norm1 : Tensor or None
        ``[Hin]``, ``x``'s dtype: the input RMSNorm's weight; None: ``x`` is already the
        attention's input (the EAGLE-3 draft normalises its two halves itself).
    norm2 : Tensor
        ``[H]``, ``x``'s dtype: the post-attention RMSNorm's weight.
    eps1, eps2 : float
        Their epsilons.
    linears : sequence of Tensor
        ``(weight, scales)`` per linear call, in order: QKV (one fused call of ``Hq``, ``Hkv``,
        ``Hkv`` heads of ``D``, or three: Q, K, V), O, gate/up (one fused call of ``I``, ``I``, or
        two: gate, up), down; as :func:`stream_linear_pack` / :func:`stream_linear_pack_blocks`
        pack them (``scales`` with no elements for a packed float weight).
    out_features : sequence of int
        The calls' output widths, 4 to 7 of them: ``(Hq + 2 Hkv) D`` or ``Hq D, Hkv D, Hkv D``;
        ``H``; ``2 I`` or ``I, I``; ``H``. Their number says which groups are fused (4 both, 5
        gate/up split, 6 QKV split, 7 neither).
    cos, sin : Tensor
        ``[B, T, D]``, ``x``'s dtype (as :func:`rope`).
    prefix_lens : Tensor
        ``[B]`` int64.
    tree_mask : Tensor
        ``[B, T, C]`` bool with ``C >= T`` (as :func:`tree_attention`): the last ``T`` of the
        ``C`` tree columns are this call's rows, written at cache slots
        ``prefix_lens[b] + C - T + t``.
    scale : float
        The attention scale.
    x_out : Tensor
        ``[B, T, H]`` contiguous, ``x``'s dtype; written with the layer's output.
    k_cache, v_cache : Tensor
        ``[B, S, Hkv, D]``: the layer's cache, its ``T`` new rows written as ``tree_mask`` says.
    residual : Tensor, optional
        ``[B, T, H]``, ``x``'s dtype: what the attention's output is added to (default ``x``).
    """
    op = "decoder_layer_"
    check_tensor(op, "x", x, dtype=(torch.float32, torch.bfloat16), ndim=3, layout="[B, T, Hin]")
    _cpu_only(op, "x", x, "the model's own decoder layer")
    n = len(out_features)
    if not 4 <= n <= 7 or not all(isinstance(w, int) and not isinstance(w, bool) for w in out_features):
        raise ValueError(f"{op}: expected 4 to 7 int out_features (QKV as 1 or 3 calls, O, gate/up as 1 or 2 calls, "
                         f"down), got {list(out_features)!r}")
    if len(linears) != 2 * n or not all(isinstance(t, Tensor) for t in linears):
        raise ValueError(f"{op}: expected {2 * n} linears tensors (weight, scales) for the {n} out_features, "
                         f"got {len(linears)}")
    qkv_calls, gate_up_calls = (3 if n in (6, 7) else 1), (2 if n in (5, 7) else 1)
    o, gate = qkv_calls, qkv_calls + 1
    down = gate + gate_up_calls
    B, T, Hin = x.shape
    r, r_name = (x, "x") if residual is None else (residual, "residual")
    if residual is not None:
        check_tensor(op, "residual", residual, dtype=x.dtype, ndim=3, layout="[B, T, H]", device=x.device,
                     device_of="x")
        if residual.shape[:2] != x.shape[:2]:
            raise ValueError(f"{op}: expected residual of x's [B, T] = {list(x.shape[:2])}, got "
                             f"{list(residual.shape[:2])}")
    H = r.shape[2]
    norms = [("norm2", norm2, H, "[H]", f"H = {r_name}.size(2)")]
    if norm1 is not None:
        norms.insert(0, ("norm1", norm1, Hin, "[Hin]", "Hin = x.size(2)"))
    for name, w, width, layout, of in norms:
        check_tensor(op, name, w, dtype=x.dtype, ndim=1, layout=layout, device=x.device, device_of="x")
        check_size(op, name, w, 0, width, of)
    for name, e in (("eps1", eps1), ("eps2", eps2)):
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not math.isfinite(e) or e < 0:
            raise ValueError(f"{op}: expected a finite {name} >= 0, got {e!r}")
    check_tensor(op, "x_out", x_out, dtype=x.dtype, ndim=3, layout="[B, T, H]", device=x.device, device_of="x")
    if tuple(x_out.shape) != (B, T, H) or not x_out.is_contiguous():
        raise ValueError(f"{op}: expected x_out contiguous of {r_name}'s shape {[B, T, H]}, got {list(x_out.shape)}")
    check_tensor(op, "k_cache", k_cache, ndim=4, layout="[B, S, Hkv, D]", device=x.device, device_of="x")
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    if qkv_calls == 1 and (D < 1 or out_features[0] % D or out_features[0] // D - 2 * Hkv < 1):
        raise ValueError(f"{op}: expected out_features[0] = (Hq + 2 Hkv) * D with Hq >= 1 (Hkv = {Hkv}, D = {D} "
                         f"from k_cache), got {out_features[0]}")
    if qkv_calls == 3 and (D < 1 or out_features[0] % D or out_features[0] < D
                           or out_features[1] != Hkv * D or out_features[2] != Hkv * D):
        raise ValueError(f"{op}: expected out_features[0:3] (Q, K, V) = Hq * D, Hkv * D, Hkv * D with Hq >= 1 "
                         f"(Hkv = {Hkv}, D = {D} from k_cache), got {list(out_features[:3])}")
    if out_features[o] != H or out_features[down] != H:
        raise ValueError(f"{op}: expected out_features[{o}] (O) and out_features[{down}] (down) to be H = "
                         f"{r_name}.size(2) = {H}, got {out_features[o]} and {out_features[down]}")
    if gate_up_calls == 1 and (out_features[gate] < 2 or out_features[gate] % 2):
        raise ValueError(f"{op}: expected out_features[{gate}] (gate and up, fused) to be even, "
                         f"got {out_features[gate]}")
    if gate_up_calls == 2 and (out_features[gate] < 1 or out_features[gate] != out_features[gate + 1]):
        raise ValueError(f"{op}: expected out_features[{gate}] (gate) and out_features[{gate + 1}] (up) to be one "
                         f"width I >= 1, got {out_features[gate]} and {out_features[gate + 1]}")
    # The kernels it chains check the rest (weights, tables, cache, lengths, mask) by name.
    _ops.decoder_layer_.default(x, norm1, float(eps1), norm2, float(eps2), list(linears),
                                [int(w) for w in out_features], cos, sin, prefix_lens, tree_mask, float(scale), x_out,
                                k_cache, v_cache, residual)


@_fake("decoder_layer_")
def _(x, norm1, eps1, norm2, eps2, linears, out_features, cos, sin, prefix_lens, tree_mask, scale, x_out, k_cache,
      v_cache, residual=None):
    torch._check(x.dim() == 3 and x_out.dim() == 3, lambda: "decoder_layer_: x and x_out must be [B, T, H]")
    return None


# ---------------------------------------------------------------------------------------------
# 14. decoder_layers_ (CPU): a target's whole stack of decoder layers in one call
# ---------------------------------------------------------------------------------------------
def decoder_layers_(x: Tensor, norms: Sequence[Tensor], eps: Sequence[float], linears: Sequence[Tensor],
                    out_features: Sequence[int], layer_calls: Sequence[int], cos: Tensor, sin: Tensor,
                    prefix_lens: Tensor, tree_mask: Tensor, scale: float, taps: Sequence[int], x_out: Tensor,
                    features: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """A target's ``L`` decoder layers of a decode step or a tree verify (CPU), in one call:
    :func:`decoder_layer_` for layer ``0 .. L - 1`` in turn, each fed the previous one's output,
    so the same bits as those ``L`` calls, without a Python round trip per layer.

    Layer ``i`` takes the next ``layer_calls[i]`` entries of ``out_features`` and the next
    ``2 layer_calls[i]`` of ``linears`` (as :func:`decoder_layer_`'s ``out_features`` and
    ``linears``), ``norm1, norm2 = norms[2 i], norms[2 i + 1]`` (likewise ``eps``), its cache
    ``k_cache[i]``, ``v_cache[i]``; ``cos``, ``sin``, ``prefix_lens``, ``tree_mask`` and
    ``scale`` are every layer's (a target's layer: ``tree_mask`` ``[B, T, T]``, no residual).
    Every layer's inputs are checked before any layer runs, so a refused call writes nothing.

    Parameters
    ----------
    x : Tensor
        ``[B, T, H]`` contiguous float32 (or bfloat16 with float / bfloat16 stream weights) on
        the CPU: the first layer's input.
    norms : sequence of Tensor
        ``2 L`` tensors ``[H]`` of ``x``'s dtype: each layer's input and post-attention RMSNorm weights.
    eps : sequence of float
        ``2 L`` epsilons, finite and ``>= 0``, paired with ``norms``.
    linears, out_features : sequences
        Every layer's :func:`decoder_layer_` ``linears`` and ``out_features``, concatenated.
    layer_calls : sequence of int
        ``L >= 1`` entries of 4 to 7: each layer's number of linear calls.
    cos, sin, prefix_lens, tree_mask, scale
        As :func:`decoder_layer_`.
    taps : sequence of int
        Layer indices in ``0 .. L``, any order: the hidden states entering those layers (``L``:
        the last layer's output) go to ``features`` side by side (EAGLE-3's feature taps).
    x_out : Tensor
        ``[B, T, H]`` contiguous, ``x``'s dtype, not ``x``: written with the last layer's output
        (before any final norm).
    features : Tensor
        ``[B, T, len(taps) H]``, ``x``'s dtype: written with the tapped hidden states.
    k_cache, v_cache : Tensor
        ``[L, B, S, Hkv, D]`` of ``x``'s dtype: each layer's ``T`` new rows written.
    """
    op = "decoder_layers_"
    check_tensor(op, "x", x, dtype=(torch.float32, torch.bfloat16), ndim=3, layout="[B, T, H]")
    _cpu_only(op, "x", x, "the model's own decoder layers")
    for name, seq in (("out_features", out_features), ("layer_calls", layer_calls), ("taps", taps)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in seq):
            raise ValueError(f"{op}: expected ints in {name}, got {list(seq)!r}")
    if not all(isinstance(t, Tensor) for t in (*norms, *linears)):
        raise ValueError(f"{op}: expected tensors in norms and linears")
    if not all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in eps):
        raise ValueError(f"{op}: expected floats in eps, got {list(eps)!r}")
    # The op checks the lists' lengths, the outputs, the caches and, layer by layer, what
    # decoder_layer_ checks, all before the first layer runs.
    _ops.decoder_layers_.default(x, list(norms), [float(e) for e in eps], list(linears), list(out_features),
                                 list(layer_calls), cos, sin, prefix_lens, tree_mask, float(scale), list(taps), x_out,
                                 features, k_cache, v_cache)


@_fake("decoder_layers_")
def _(x, norms, eps, linears, out_features, layer_calls, cos, sin, prefix_lens, tree_mask, scale, taps, x_out,
      features, k_cache, v_cache):
    torch._check(x.dim() == 3 and x_out.dim() == 3, lambda: "decoder_layers_: x and x_out must be [B, T, H]")
    return None


# ---------------------------------------------------------------------------------------------
# 15. corpus_lookup (CPU, a host op): datastore lookup
# ---------------------------------------------------------------------------------------------
#: The document separator of a corpus (token ids are below it).
CORPUS_SEP = 65535


def corpus_lookup(corpus: Tensor, suffix_order: Tensor, context: Tensor, k: int, min_match: int, max_match: int,
                  sample: int, agree: float) -> Tuple[Tensor, Tensor]:
    """The longest match of ``context``'s last tokens in a token corpus, and the continuation most
    of its occurrences agree on (the lookup corpus of :mod:`heterospec.datastore`; a host op).

    The corpus read backwards is ``rev`` (``rev[j] = corpus[N - 1 - j]``; ``65535`` before the
    corpus start). The longest ``n <= max_match`` for which ``context[-n:]`` occurs is found by
    narrowing one range of ``suffix_order`` a token at a time. Of its ``count`` occurrences,
    ``rows = min(count, sample)`` are read, occurrence ``lo + i * (count - 1) // (rows - 1)`` of
    the range; position by position the chain takes the most common next token of the rows that
    agreed so far (the smallest token on a tie), while at least ``agree`` of them hold it and it
    is not the separator.

    Parameters
    ----------
    corpus : Tensor
        ``[N]`` int32 on the CPU, contiguous: token ids below ``65535``, documents separated by
        ``65535`` (:data:`CORPUS_SEP`).
    suffix_order : Tensor
        ``[N]`` int32 on the CPU, contiguous: the positions ``j`` of ``rev`` sorted by their first
        ``max_match`` tokens (lexicographic; an entry outside ``[0, N)`` raises where it is read,
        an unsorted order gives matches that are not the longest).
    context : Tensor
        ``[L]`` int64 on the CPU: a request's tokens so far; a token outside ``[0, 65535)`` ends
        the match.
    k : int
        ``>= 0``: the longest chain returned.
    min_match : int
        ``1 <= min_match <= max_match``: a shorter match returns no chain.
    max_match : int
        ``>= 1``: the longest match looked for.
    sample : int
        ``>= 1``: the most occurrences read.
    agree : float
        ``0 <= agree <= 1``.

    Returns
    -------
    chain : Tensor
        ``[k]`` int64: the chain, ``-1`` after its end.
    match : Tensor
        ``[4]`` int64: the match length ``n`` (0: none), its occurrences ``count``, the ``rows``
        read (0 when no chain was sought) and how many of them agree on ``chain[0]``.
    """
    op = "corpus_lookup"
    for name, t in (("corpus", corpus), ("suffix_order", suffix_order)):
        check_tensor(op, name, t, dtype=torch.int32, ndim=1, layout="[N]")
        _cpu_only(op, name, t, "the same op on CPU tensors (the corpus is host data)")
        if not t.is_contiguous():
            raise ValueError(f"{op}: expected {name} to be contiguous")
    check_size(op, "suffix_order", suffix_order, 0, corpus.shape[0], "N = corpus.size(0)")
    check_tensor(op, "context", context, dtype=_i64, ndim=1, layout="[L]")
    _cpu_only(op, "context", context, "the same op on CPU tensors (the corpus is host data)")
    k = check_int(op, "k", k, minimum=0)
    max_match = check_int(op, "max_match", max_match, minimum=1)
    min_match = check_int(op, "min_match", min_match, minimum=1)
    if min_match > max_match:
        raise ValueError(f"{op}: expected 1 <= min_match <= max_match = {max_match}, got {min_match}")
    sample = check_int(op, "sample", sample, minimum=1)
    if isinstance(agree, bool) or not isinstance(agree, (int, float)) or not 0.0 <= float(agree) <= 1.0:
        raise ValueError(f"{op}: expected 0 <= agree <= 1, got {agree!r}")
    return _ops.corpus_lookup.default(corpus, suffix_order, context, k, min_match, max_match, sample, float(agree))


@_fake("corpus_lookup")
def _(corpus, suffix_order, context, k, min_match, max_match, sample, agree):
    return context.new_empty((k,)), context.new_empty((4,))


# ---------------------------------------------------------------------------------------------
# 16. greedy_tokens (CPU): the greedy pick
# ---------------------------------------------------------------------------------------------
def greedy_tokens(logits: Tensor) -> Tensor:
    """The first index of the maximum over the last dimension of ``logits``, as ``torch.argmax``
    (a NaN counts as the maximum: the first NaN's index; ``-0.0`` equals ``0.0``).

    torch's CPU reduction takes ~1 ns an element (~45 us for a 49,152-entry row on a Zen 4); this
    kernel two vector passes (a few us), which a verified tree pays once per node.

    Parameters
    ----------
    logits : Tensor
        ``[..., V]`` float32 or bfloat16 on the CPU, ``V >= 1`` (any strides).

    Returns
    -------
    Tensor
        ``[...]`` int64: per row, the index of its greedy token.
    """
    _check_cpu_logit_rows("greedy_tokens", logits, "logits.argmax(dim=-1) on a GPU")
    return _ops.greedy_tokens.default(logits)


def _check_cpu_logit_rows(op: str, logits, on_gpu: str) -> None:
    """``logits [..., V]``: a float32 or bfloat16 CPU tensor with ``V >= 1`` (the row ops' input)."""
    if not isinstance(logits, Tensor):
        raise ValueError(f"{op}: expected logits to be a tensor, got {type(logits).__name__}")
    if logits.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{op}: expected logits to be float32 or bfloat16, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{op}: expected logits of shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    _cpu_only(op, "logits", logits, on_gpu)


@_fake("greedy_tokens")
def _(logits):
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# 17. sample_tokens (CPU): the keyed draw
# ---------------------------------------------------------------------------------------------
def sample_tokens(logits: Tensor, uniforms: Tensor, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> Tuple[Tensor, Tensor]:
    """Per row of ``logits``, the token that inverse CDF with the row's uniform draws from
    ``softmax(logits / temperature)`` cut to the ``top_k`` most likely tokens (ties with the
    k-th stay) and the ``top_p`` nucleus (tokens ranked by probability, ties by lower id, kept
    while the mass before them is below ``top_p``), and whether the row was a distribution.

    The same draw as :func:`heterospec.sampling.processed_probs` then
    :func:`heterospec.sampling.sample_rows`, up to rounding where a uniform falls within ~1e-7 of
    a boundary between two tokens; probabilities below ``exp(-87.3)`` of the row's largest count
    as 0. The composed torch path sums the whole vocabulary in float64 and masks it several
    times; this kernel makes two vector passes, sorts the nucleus candidates only and scans to
    the token (bench/RESULTS.md, eightieth session).

    Parameters
    ----------
    logits : Tensor
        ``[..., V]`` float32 or bfloat16 on the CPU, ``V >= 1`` (any strides).
    uniforms : Tensor
        ``[...]`` float64 in ``[0, 1)`` on the CPU, one per row (keyed draws:
        :func:`heterospec.sampling.position_uniforms`).
    temperature : float
        Finite, ``> 0`` (temperature 0 is greedy: :func:`greedy_tokens`).
    top_k : int
        ``>= 0``; 0 (or ``>= V``) keeps every token.
    top_p : float
        ``0 < top_p <= 1``; 1 keeps every token.

    Returns
    -------
    tokens : Tensor
        ``[...]`` int64: per row, the drawn token (0 for a row that is not a distribution).
    ok : Tensor
        ``[...]`` bool: False for a row holding a NaN or ``+inf``, or only ``-inf``.
    """
    op, on_gpu = "sample_tokens", "heterospec.sampling.processed_probs and sample_rows on a GPU"
    _check_cpu_logit_rows(op, logits, on_gpu)
    if not isinstance(uniforms, Tensor):
        raise ValueError(f"{op}: expected uniforms to be a tensor, got {type(uniforms).__name__}")
    if uniforms.dtype != torch.float64 or uniforms.shape != logits.shape[:-1]:
        raise ValueError(f"{op}: expected uniforms float64 of shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
                         f"got {uniforms.dtype} {tuple(uniforms.shape)}")
    _cpu_only(op, "uniforms", uniforms, on_gpu)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature <= 0:
        raise ValueError(f"{op}: expected a finite temperature > 0 (temperature 0 is greedy: use greedy_tokens), "
                         f"got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"{op}: expected top_k an int >= 0 (0: no top-k), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"{op}: expected 0 < top_p <= 1, got {top_p!r}")
    return _ops.sample_tokens.default(logits, uniforms, float(temperature), int(top_k), float(top_p))


@_fake("sample_tokens")
def _(logits, uniforms, temperature, top_k, top_p):
    shape = logits.shape[:-1]
    return logits.new_empty(shape, dtype=torch.int64), logits.new_empty(shape, dtype=torch.bool)


# ---------------------------------------------------------------------------------------------
# Error flags of the CUDA ops (no host sync) and the checks that raise the CPU ops' errors
# ---------------------------------------------------------------------------------------------
# Raising on a value inside a CUDA tensor needs a device sync, so the CUDA kernels flag bad values
# in their outputs instead (documented per op). The engine folds these flags into the one packed
# device-to-host read of a round and raises from the host values; the messages are the CPU ops'.


def topk_entropy_invalid(topk_logprobs: Tensor) -> Tensor:
    """Rows that :func:`topk_entropy` flagged as invalid (NaN, ``+inf`` or only ``-inf`` logits).

    No host sync. ``topk_logprobs``: ``[M, k]`` float32 (``k >= 1``) from :func:`topk_entropy`.
    Returns ``[M]`` bool, ``topk_logprobs[:, 0] == -inf`` (a valid row's best log-probability is
    finite). Always False on CPU, where the op raises instead.
    """
    check_tensor("topk_entropy_invalid", "topk_logprobs", topk_logprobs, dtype=torch.float32, ndim=2,
                 layout="[M, k]")
    if topk_logprobs.size(1) == 0:
        return torch.zeros(topk_logprobs.size(0), dtype=torch.bool, device=topk_logprobs.device)
    return topk_logprobs[:, 0] == float("-inf")


def _row_problem(row: Tensor) -> str:
    """The CPU op's wording for an invalid logits row (csrc/cpu/entropy.cpp, row_problem)."""
    row = row.float()
    if bool(torch.isnan(row).any()):
        return "contains NaN"
    if bool((row == float("inf")).any()):
        return "contains +inf"
    return "is all -inf (no token has positive probability)"


def raise_topk_entropy_errors(invalid, logits: Optional[Tensor] = None) -> None:
    """Raise the CPU :func:`topk_entropy` ``ValueError`` if any row is flagged.

    Parameters
    ----------
    invalid : Tensor or sequence
        ``[M]`` bool / int flags from :func:`topk_entropy_invalid`, as a tensor (read here: one
        host read) or as host values already read (a list; no sync).
    logits : Tensor, optional
        ``[M, V]``, the logits the flags belong to: names the problem of the first flagged row
        exactly as the CPU op does (reads that row, only on the error path). Without it the
        message says "contains NaN or +inf, or is all -inf".

    Raises
    ------
    ValueError
        ``topk_entropy: row r of logits contains NaN; every row needs at least one finite logit
        and no NaN or +inf`` (``r`` = the first flagged row).
    """
    flags = invalid.tolist() if isinstance(invalid, Tensor) else list(invalid)
    r = next((i for i, f in enumerate(flags) if f), None)
    if r is None:
        return
    problem = "contains NaN or +inf, or is all -inf"
    if logits is not None and logits.dim() == 2 and r < logits.size(0):
        problem = _row_problem(logits[r])
    raise ValueError(f"topk_entropy: row {r} of logits {problem}; "
                     "every row needs at least one finite logit and no NaN or +inf")


def verify_sampling_invalid(accept_path: Tensor, accept_len: Tensor, bonus: Tensor) -> Tensor:
    """Requests whose :func:`verify_sampling` walk reached a ``target_probs`` row that is not a
    distribution (CUDA flags them with ``bonus = -1``).

    No host sync. Takes the op's three outputs (``[B, T]``, ``[B]``, ``[B]`` int64). Returns
    ``[B]`` int64: ``-1`` for a valid request, else the tree position ``i`` of the invalid row
    (``accept_path[b, accept_len[b]]``). Always ``-1`` on CPU, where the op raises instead.
    """
    op = "verify_sampling_invalid"
    check_tensor(op, "accept_path", accept_path, dtype=_i64, ndim=2, layout="[B, T]")
    B = accept_path.size(0)
    _vec(op, "accept_len", accept_len, B, accept_path.device, "accept_path")
    _vec(op, "bonus", bonus, B, accept_path.device, "accept_path")
    if accept_path.size(1) == 0:
        return torch.full_like(bonus, -1)
    idx = accept_len.clamp(0, accept_path.size(1) - 1)[:, None]
    node = accept_path.gather(1, idx)[:, 0]
    return torch.where(bonus < 0, node.clamp(min=0), torch.full_like(node, -1))


def raise_verify_sampling_errors(invalid) -> None:
    """Raise the CPU :func:`verify_sampling` ``ValueError`` if any request is flagged.

    Parameters
    ----------
    invalid : Tensor or sequence
        ``[B]`` int64 from :func:`verify_sampling_invalid` (``-1`` = valid, else the tree
        position of the invalid row), as a tensor (read here: one host read) or as host values
        already read (a list; no sync).

    Raises
    ------
    ValueError
        ``verify_sampling: target_probs[b, i] is not a valid distribution (a negative, NaN or inf
        entry, or all zeros)`` for the first flagged request ``b``.
    """
    nodes = invalid.tolist() if isinstance(invalid, Tensor) else list(invalid)
    for b, i in enumerate(nodes):
        if int(i) >= 0:
            raise ValueError(f"verify_sampling: target_probs[{b}, {int(i)}] is not a valid distribution "
                             "(a negative, NaN or inf entry, or all zeros)")
