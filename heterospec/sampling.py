"""The target's processed distribution (temperature, top-k, top-p), shared by every method.

Plain sampling and speculative verification must draw from exactly the same distribution, so both
go through :func:`processed_probs`.
"""

from __future__ import annotations

import torch

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
        if logits.dtype in (torch.float32, torch.bfloat16) and logits.dim() >= 1 and logits.shape[-1] > 0:
            # the raw op: the caller's logits are a model's output (the op checks them again)
            return torch.ops.heterospec.greedy_tokens.default(logits)
        return torch.max(logits, dim=-1).indices
    return logits.argmax(dim=-1)


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
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= params.top_p      # the top token has mass_before == 0: kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def make_generator(seed, device) -> torch.Generator:
    """A generator on ``device``: seeded when ``seed`` is given, else from fresh entropy."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def sample(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs [B, V]`` (inverse CDF with a uniform from ``gen``).

    A row that is not a distribution (NaN, inf or no mass: the target produced non-finite
    logits) is an error, never a token."""
    u = torch.rand(probs.shape[:-1] + (1,), generator=gen, device=probs.device, dtype=torch.float64)
    cdf = torch.cumsum(probs.double(), dim=-1)
    total = cdf[..., -1:]
    bad = ~(torch.isfinite(total) & (total > 0))
    if bool(bad.any()):
        row = int(bad.flatten().nonzero()[0, 0])
        raise ValueError(f"sampling: the target's distribution for request {row} is not valid (NaN, inf or no "
                         "mass): the target model produced non-finite logits")
    idx = torch.searchsorted(cdf, u * total, right=True)
    # Rounding can push u * total onto the last cumulative value: take the last token with mass.
    last_nonzero = (probs > 0).to(torch.int64).cumsum(-1).argmax(-1, keepdim=True)
    idx = torch.minimum(idx, last_nonzero)
    return idx.squeeze(-1)
