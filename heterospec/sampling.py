"""The target's processed distribution (temperature, top-k, top-p) and how every method samples it.

Plain sampling and speculative verification draw from exactly the same distribution: both go
through :func:`draw_rows` (:func:`processed_probs` then :func:`sample_rows`, or on the CPU the
``sample_tokens`` op that computes the same draw), and both draw the token at sequence position
``s`` of request ``b`` by inverse CDF with one uniform keyed to ``(seed, b, s)``
(:func:`position_uniforms`).
Keyed draws make a sample a function of the seed and the target alone: the token at ``s`` is
the target's draw from its distribution given the tokens before ``s``, whichever tree, chain or
plain step evaluated that row, so every method (and every policy, batch and timing) gives the
same sample for the same seed, and speculation verifies a draft token by comparing it with the
target's own draw at that node (:meth:`heterospec.Engine._verify`). Each position's uniform is
independent of the tokens before it, so the output is an exact sample of the target: as plain
sampling with a fresh uniform per step. A deterministic top-k draft child is accepted exactly
when the target's draw equals it, with probability ``p(child)``: what multi-candidate rejection
sampling over one-hot drafts (:func:`heterospec.ops.verify_sampling`) accepts.
"""

from __future__ import annotations

import secrets
from typing import Optional, Tuple

import torch

from ._checks import host_reads_allowed
from .config import SamplingParams


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of ``logits`` over the last dimension: the first maximal entry's index, as
    ``torch.argmax`` (a NaN counts as the maximum, as there). On CPU, float32 and bfloat16 logits
    go to our ``greedy_tokens`` op (two vector passes a row, ~9 us for a 49,152 vocabulary where
    torch's CPU reduction took ~45 us: a verified tree pays it once per node; bench/RESULTS.md,
    sixty-seventh session); other CPU logits to ``torch.max``'s index (a third of ``argmax``'s
    time there). tests/test_sampling_processing.py and tests/test_greedy_op.py check that they
    all agree with ``torch.argmax``."""
    if logits.device.type == "cpu":
        if _row_op_serves(logits):
            # the raw op: the caller's logits are a model's output (the op checks them again)
            return torch.ops.heterospec.greedy_tokens.default(logits)
        return torch.max(logits, dim=-1).indices
    return logits.argmax(dim=-1)


def _row_op_serves(logits: torch.Tensor) -> bool:
    """Whether our CPU row ops (greedy_tokens, sample_tokens) take these logits: float32 or
    bfloat16, ``[..., V]`` with ``V >= 1``."""
    return logits.dtype in (torch.float32, torch.bfloat16) and logits.dim() >= 1 and logits.shape[-1] > 0


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``softmax(logits / T)`` restricted to the top-k tokens and the top-p nucleus, renormalised.

    ``logits``: ``[..., V]`` any float dtype. Returns float32 probabilities of the same shape.
    The nucleus keeps the smallest prefix of tokens (sorted by probability, ties by lower id) whose
    mass reaches ``top_p``; the most likely token is always kept.
    """
    if params.greedy:
        raise ValueError("processed_probs: temperature 0 is greedy decoding; use argmax")
    # Shift by the row max before scaling: (x - max) / T <= 0 cannot overflow, however small T is
    # (x / T would reach inf for T ~ 1e-38 and turn the softmax into NaN).
    x = logits.float()
    x = (x - x.amax(dim=-1, keepdim=True)) / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        probs = probs.masked_fill(nucleus_drop(probs, params.top_p), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


# Candidate counts a CPU looks for the nucleus in before it sorts a row's whole vocabulary: a
# stable sort of a large vocabulary costs milliseconds a row there, a top-256 a small part of
# that, and a sampled step pays it for every row it draws (a verified tree, for each node;
# bench/RESULTS.md, seventy-ninth session). A GPU sorts every row (fast there, and of static
# shape, as a captured CUDA graph needs).
NUCLEUS_TIERS = (256, 4096)


def nucleus_drop(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``[..., V]`` bool: the tokens outside each row's top-p nucleus. Sorted by probability (ties
    by lower id), a token is dropped when the mass before it (a running float32 sum, accumulated
    as ``torch.cumsum`` does) reaches ``top_p``; the most likely token is always kept.

    A row is decided among its ``K`` most likely tokens (``NUCLEUS_TIERS``, then its whole
    vocabulary) when the first of them whose probability equals the ``K``-th's already has mass
    ``top_p`` before it: every token ranked from there on is dropped, and every one ranked before
    it is a candidate, in the same order and with the same running sums as in a full sort (a tie
    at the ``K``-th probability cannot change them). Rows are decided alone: a row's nucleus does
    not depend on the rows beside it. Off the CPU every row is sorted whole (no data-dependent
    shapes)."""
    shape, V = probs.shape, probs.shape[-1]
    flat = probs.reshape(-1, V)
    drop = torch.ones_like(flat, dtype=torch.bool)
    todo = torch.arange(flat.shape[0], device=flat.device)
    for K in NUCLEUS_TIERS if flat.device.type == "cpu" else ():
        if K >= V or todo.numel() == 0:
            break
        rows = flat.index_select(0, todo)
        vals, idx = torch.topk(rows, K, dim=-1, sorted=False)
        by_id = idx.argsort(dim=-1)                                   # ties: lower id first
        idx, vals = idx.gather(1, by_id), vals.gather(1, by_id)
        vals, order = torch.sort(vals, dim=-1, descending=True, stable=True)
        idx = idx.gather(1, order)
        mass_before = torch.cumsum(vals, dim=-1) - vals
        first_tie = (vals > vals[:, -1:]).sum(-1, keepdim=True)      # first position valued as the K-th
        decided = (mass_before.gather(1, first_tie)[:, 0] >= top_p)
        keep = (mass_before < top_p) & (torch.arange(K, device=flat.device)[None, :] < first_tie)
        done = todo[decided]
        if done.numel():
            row_drop = torch.ones(done.numel(), V, dtype=torch.bool, device=flat.device)
            row_drop.scatter_(1, idx[decided], ~keep[decided])
            drop.index_copy_(0, done, row_drop)
        todo = todo[~decided]
    if todo.numel():
        rows = flat.index_select(0, todo)
        sorted_p, order = torch.sort(rows, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop.index_copy_(0, todo, torch.zeros_like(sorted_p, dtype=torch.bool).scatter(-1, order, mass_before >= top_p))
    return drop.reshape(shape)


def sample(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs [..., V]``, by inverse CDF with a uniform from ``gen``
    (tooling that samples without keys; the engine samples with :func:`sample_at`)."""
    u = torch.rand(probs.shape[:-1], generator=gen, device=probs.device, dtype=torch.float64)
    return sample_at(probs, u)


def sample_at(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [..., V]`` by inverse CDF with the uniforms ``u [...]``
    (float64 in ``[0, 1)``). A row that is not a distribution (NaN, inf or no mass: the target
    produced non-finite logits) is an error, never a token; inside a CUDA graph capture, where
    nothing may be read on the host, :func:`sample_rows`' flags are the caller's to check."""
    return _valid_or_raise(*sample_rows(probs, u))


def draw(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    """The keyed draw of each row of ``logits [..., V]`` with its uniform ``u [...]``
    (:func:`draw_rows`), a row that is not a distribution raised as in :func:`sample_at`."""
    return _valid_or_raise(*draw_rows(logits, params, u))


def _valid_or_raise(tokens: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    if host_reads_allowed(ok) and not bool(ok.all()):
        row = int((~ok).flatten().nonzero()[0, 0])
        raise ValueError(f"sampling: the target's distribution for request {row} is not valid (NaN, inf or no "
                         "mass): the target model produced non-finite logits")
    return tokens


def draw_rows(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [...], ok [...])``: each row of ``logits [..., V]`` drawn from its processed
    distribution (:func:`processed_probs`) by inverse CDF with its uniform ``u [...]`` (float64),
    and whether the row was a distribution. No host read. Float32 and bfloat16 CPU logits go to our
    ``sample_tokens`` op (the same draw up to rounding at a token boundary, several times faster
    than the composed path: bench/RESULTS.md, eightieth session), everything else to
    :func:`processed_probs` then :func:`sample_rows` (fixed shapes, as a CUDA graph needs)."""
    if logits.device.type == "cpu" and _row_op_serves(logits):
        # the raw op: the caller's logits are a model's output, its params checked (SamplingParams)
        return torch.ops.heterospec.sample_tokens.default(logits, u, float(params.temperature), int(params.top_k),
                                                          float(params.top_p))
    return sample_rows(processed_probs(logits, params), u)


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [...], ok [...])``: each row's inverse-CDF token for its uniform, and whether the
    row was a distribution (finite, with mass). No host read. A row's token depends on that row
    and its uniform alone (a float64 running sum over the vocabulary in order), so a tree's row
    and a one-token step's row with the same values and uniform give the same token."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    total = cdf[..., -1:].contiguous()
    ok = (torch.isfinite(total) & (total > 0))[..., 0]
    idx = torch.searchsorted(cdf, u[..., None].double() * total, right=True)
    # Rounding can push u * total onto the last cumulative value: take the last token with mass,
    # the first where the running sum reaches the total.
    last = torch.searchsorted(cdf, total, right=False)
    idx = torch.minimum(idx, last).clamp(max=probs.shape[-1] - 1)
    return idx.squeeze(-1), ok


# -- keyed uniforms -----------------------------------------------------------------------------
# A request's key is two 32-bit lanes from its call's seed and its index in the call (host
# integers, splitmix64); a position's uniform mixes the position into them on the device with a
# 32-bit integer hash whose products stay below 2**59, so int64 tensor arithmetic is exact (no
# wrapping multiply) on every device, inside CUDA graphs, with no generator state.
_MASK32, _MASK64 = 0xFFFFFFFF, (1 << 64) - 1
_HASH_MUL = 0x45D9F3B


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def request_keys(seed: Optional[int], batch_size: int, device) -> torch.Tensor:
    """``[batch_size, 2]`` int64 keys, one per request of a call: from ``seed`` and the request's
    index (request ``b`` of any call with this seed samples alike), or from fresh entropy."""
    base = secrets.randbits(63) if seed is None else int(seed)
    lanes = []
    for b in range(batch_size):
        z = _splitmix64(_splitmix64(base) ^ b)
        lanes.append([z & _MASK32, z >> 32])
    return torch.tensor(lanes, dtype=torch.int64, device=device).reshape(batch_size, 2)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in ``[0, 2**32)`` (two xorshift-multiply rounds)."""
    x = (((x >> 16) ^ x) * _HASH_MUL) & _MASK32
    x = (((x >> 16) ^ x) * _HASH_MUL) & _MASK32
    return (x >> 16) ^ x


def position_uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in ``[0, 1)`` (53 random bits) for ``positions [B, ...]`` (int64 sequence
    positions of the tokens to draw) of the requests with ``keys [B, 2]``."""
    view = (keys.shape[0],) + (1,) * (positions.dim() - 1)
    k0, k1 = keys[:, 0].view(view), keys[:, 1].view(view)
    p = positions.to(torch.int64) & _MASK32
    hi = _hash32(_hash32(p ^ k0) ^ k1)
    lo = _hash32(_hash32(p ^ k1 ^ 0x9E3779B9) ^ k0)
    return ((hi << 21) | (lo >> 11)).to(torch.float64) * 2.0 ** -53
