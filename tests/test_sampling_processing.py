"""Golden tests of :func:`heterospec.sampling.processed_probs` (temperature, top-k, top-p).

Two independent references: hand-computed small cases, and transformers' logits warpers
(``tests/sampling_ref.py``), which the sampling-law tests also use to build their expected law.
"""

import math

import pytest
import torch

from heterospec.config import SamplingParams
from heterospec.sampling import processed_probs
from tests.sampling_ref import reference_probs

P4 = [0.5, 0.3, 0.15, 0.05]


def _probs(logits, **kw):
    return processed_probs(torch.tensor(logits, dtype=torch.float64), SamplingParams(**kw)).double()


def _norm(xs):
    s = sum(xs)
    return [x / s for x in xs]


@pytest.mark.parametrize("kw,expected", [
    # softmax(log p / T) = p ** (1 / T), renormalised
    (dict(temperature=1.0), P4),
    (dict(temperature=0.5), _norm([p ** 2 for p in P4])),
    (dict(temperature=2.0), _norm([math.sqrt(p) for p in P4])),
    # top-k keeps the k largest, then renormalises
    (dict(temperature=1.0, top_k=2), [0.625, 0.375, 0.0, 0.0]),
    (dict(temperature=2.0, top_k=2), _norm([math.sqrt(0.5), math.sqrt(0.3), 0.0, 0.0])),
    (dict(temperature=1.0, top_k=4), P4),                     # k = V: no-op
    # top-p keeps the smallest prefix whose mass reaches top_p (the top token always)
    (dict(temperature=1.0, top_p=0.75), [0.625, 0.375, 0.0, 0.0]),
    (dict(temperature=1.0, top_p=0.85), _norm([0.5, 0.3, 0.15, 0.0])),
    (dict(temperature=1.0, top_p=0.3), [1.0, 0.0, 0.0, 0.0]),
    # top-p applies to the tempered distribution: at T = 0.5 the first two carry 0.93 of the mass
    (dict(temperature=0.5, top_p=0.9), _norm([0.25, 0.09, 0.0, 0.0])),
    # top-k, then top-p over the renormalised top-k mass (0.15 / 0.95 > 0.1: three survive top-p 0.9)
    (dict(temperature=1.0, top_k=3, top_p=0.9), _norm([0.5, 0.3, 0.15, 0.0])),
    (dict(temperature=1.0, top_k=3, top_p=0.8), [0.625, 0.375, 0.0, 0.0]),
])
def test_hand_computed_cases(kw, expected):
    got = _probs([math.log(p) + 1.7 for p in P4], **kw)      # a shift of the logits changes nothing
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0)


def test_ties_break_to_the_lower_id():
    # four equal tokens: top-p 0.5 keeps the first two; top-k 3 keeps ids 0..2 (all >= the 3rd value)
    torch.testing.assert_close(_probs([1.0] * 4, temperature=1.0, top_p=0.5),
                               torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(_probs([2.0, 1.0, 1.0, 0.0], temperature=1.0, top_k=2).gt(0),
                               torch.tensor([True, True, True, False]))   # a tie at the k-th value keeps both


def test_tiny_temperature_is_argmax():
    torch.testing.assert_close(_probs([0.0, 3.0, 2.999, -1.0], temperature=1e-30),
                               torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64))


def _param_grid():
    return [(t, k, p) for t in (0.3, 0.7, 1.0, 1.6) for k in (0, 1, 5, 40) for p in (1.0, 0.95, 0.6, 0.2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_matches_transformers_warpers(dtype):
    """Random peaked logits, every combination of temperature / top-k / top-p, against
    transformers' warpers. Rows whose nucleus boundary falls within rounding of top_p, or
    between two equal probabilities, are skipped (the two may legitimately differ there)."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 97, generator=g, dtype=torch.float64) * 3.0).to(dtype)
    checked = 0
    for t, k, p in _param_grid():
        ours = processed_probs(logits, SamplingParams(temperature=t, top_k=k, top_p=p)).double()
        ref = reference_probs(logits, t, k, p)
        ok = _rows_away_from_the_top_p_boundary(logits, t, k, p)
        assert ok.sum() >= 56, (t, k, p)
        assert torch.equal(ours[ok] > 0, ref[ok] > 0), f"kept sets differ at T={t} top_k={k} top_p={p}"
        torch.testing.assert_close(ours[ok], ref[ok], atol=2e-6, rtol=1e-5, msg=f"T={t} top_k={k} top_p={p}")
        checked += int(ok.sum())
    assert checked > 0.95 * 64 * len(_param_grid())


def _rows_away_from_the_top_p_boundary(logits, t, k, p):
    if p >= 1.0:
        return torch.ones(logits.shape[0], dtype=torch.bool)
    x = logits.double() / t
    if k > 0:
        x = x.masked_fill(x < x.topk(k, -1).values[:, -1:], -math.inf)
    probs = torch.sort(torch.softmax(x, -1), -1, descending=True).values
    cum = probs.cumsum(-1)
    # the last kept and the first dropped token tie: either may be kept (ties go to the lower id
    # here; transformers' ascending sort orders ties arbitrarily)
    n_keep = (cum - probs < p).sum(-1, keepdim=True)
    boundary_tie = probs.gather(-1, n_keep - 1) == probs.gather(-1, n_keep.clamp(max=probs.shape[-1] - 1))
    return ((cum - p).abs() > 1e-4).all(-1) & ~boundary_tie[:, 0]


def test_greedy_params_are_refused():
    with pytest.raises(ValueError, match="greedy"):
        processed_probs(torch.zeros(3), SamplingParams(temperature=0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_greedy_tokens_is_argmax(dtype):
    """greedy_tokens (torch.max's index on CPU) equals torch.argmax: ties go to the first maximal
    entry, a NaN wins, -inf rows give index 0, over a vocabulary-sized row and a leading batch."""
    from heterospec.sampling import greedy_tokens
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 49152, generator=g).to(dtype)
    x[0, 0, [7, 300, 49000]] = 50.0                          # a three-way tie
    x[0, 1, 11] = float("nan")
    x[0, 2, :] = float("-inf")
    x[1, 0, :] = 1.0                                         # all equal
    x[1, 1, [5, 9]] = float("inf")
    got, want = greedy_tokens(x), torch.argmax(x, dim=-1)
    assert got.dtype == torch.int64 and got.shape == (3, 5)
    assert torch.equal(got, want)
    assert got[0, 0] == 7 and got[0, 1] == 11 and got[1, 0] == 0 and got[1, 1] == 5
    assert torch.equal(greedy_tokens(x[:, 0]), torch.argmax(x[:, 0], dim=-1))     # non-contiguous rows


def _full_sort_drop(probs, top_p):
    """The top-p rule by a full stable sort of each row (what nucleus_drop decides among its
    candidates first)."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    return torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)


@pytest.mark.parametrize("scale", [0.05, 0.5, 2.0, 8.0])
def test_nucleus_from_candidates_is_the_full_sort_rule(scale):
    """nucleus_drop decides a row among its top 256 / 4,096 tokens when that settles it, else by
    a full sort: the same tokens either way (peaked rows: the first tier; flat ones: the sort),
    ties by lower id included, and a row's nucleus does not depend on the rows beside it."""
    from heterospec.sampling import NUCLEUS_TIERS, nucleus_drop

    g = torch.Generator().manual_seed(int(scale * 100))
    V = 8 * NUCLEUS_TIERS[-1]
    x = torch.randn(12, V, generator=g) * scale
    x[::3] = (x[::3] * 2).round() / 2              # many exact ties
    x[1, :300] = x[1, 0]                            # a tie across the first tier's boundary
    probs = torch.softmax(x, dim=-1)
    for top_p in (0.3, 0.9, 0.95, 0.999):
        want = _full_sort_drop(probs, top_p)
        got = nucleus_drop(probs, top_p)
        assert torch.equal(got, want), top_p
        assert torch.equal(nucleus_drop(probs[5:6], top_p), want[5:6])
        assert not got.gather(1, probs.argmax(-1, keepdim=True)).any(), "the most likely token is kept"


def test_sample_rows_takes_the_inverse_cdf_token_and_never_one_without_mass():
    from heterospec.sampling import sample_rows

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2], [0.0, 0.0, 1.0, 0.0, 0.0]])
    for u, want in ((0.0, [1, 0, 2]), (0.49, [1, 2, 2]), (0.5, [3, 2, 2]), (1.0 - 2 ** -53, [3, 4, 2])):
        tokens, ok = sample_rows(probs, torch.full((3,), u, dtype=torch.float64))
        assert tokens.tolist() == want and ok.all(), u
    tokens, ok = sample_rows(torch.tensor([[float("nan"), 1.0], [0.0, 0.0]]), torch.tensor([0.3, 0.3], dtype=torch.float64))
    assert ok.tolist() == [False, False] and tokens.min() >= 0 and tokens.max() <= 1
