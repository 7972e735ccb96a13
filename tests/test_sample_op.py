"""sample_tokens (op 17): the keyed draw against its pure-PyTorch reference,
``sample_rows(processed_probs(logits, params), u)`` (heterospec/sampling.py; processed_probs is
itself checked against transformers' warpers in test_sampling_processing.py)."""

import math

import pytest
import torch

from heterospec import ops
from heterospec.config import SamplingParams
from heterospec.sampling import draw, draw_rows, processed_probs, sample_rows
from isa_util import run_on_each_isa

#: How close (in probability mass) a uniform may fall to a boundary between two tokens for the op
#: and the reference to pick different ones: both round, in different orders.
BOUNDARY = 1e-5


def reference(logits, u, temperature, top_k=0, top_p=1.0):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = processed_probs(logits.float(), params)
    tokens, ok = sample_rows(probs, u)
    return tokens, ok, probs


def rows(seed: int, R: int, V: int, dtype=torch.float32, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g) * scale
    if V > 4:
        x[0, : V // 4] = float("-inf")                     # leading tokens without mass
        x[1] = (x[1]).round()                              # ties
    return x.to(dtype), torch.rand(R, generator=g, dtype=torch.float64)


def assert_same_draws(logits, u, temperature, top_k=0, top_p=1.0):
    """Every row: the op's token is the reference's, or the uniform sits within BOUNDARY of the
    boundary between them; always a token the processed distribution gives mass to."""
    got, ok = ops.sample_tokens(logits, u, temperature, top_k, top_p)
    want, want_ok, probs = reference(logits, u, temperature, top_k, top_p)
    assert torch.equal(ok, want_ok)
    flat_p, flat_u = probs.reshape(-1, probs.shape[-1]).double(), u.reshape(-1)
    differ = 0
    for r, (a, b) in enumerate(zip(got.reshape(-1).tolist(), want.reshape(-1).tolist())):
        if not bool(ok.reshape(-1)[r]):
            continue
        assert flat_p[r, a] > 0, f"row {r}: drew token {a}, which the processed distribution excludes"
        if a != b:
            cdf = torch.cumsum(flat_p[r], 0)
            target = float(flat_u[r]) * float(cdf[-1])
            gap = abs(float(cdf[min(a, b)]) - target)
            assert gap < BOUNDARY, f"row {r}: op {a}, reference {b}, uniform {target:.9f} is {gap:.2e} from the boundary"
            differ += 1
    return got, differ


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [1, 5, 8, 63, 64, 65, 1000, 49152])
def test_matches_the_reference_over_the_settings(dtype, V):
    logits, u = rows(V, 6, V, dtype)
    total_differ = 0
    for temperature in (0.3, 0.8, 1.0, 1.7):
        for top_k in (0, 1, 3, 50, V):
            for top_p in (1.0, 0.95, 0.5, 0.05):
                _, differ = assert_same_draws(logits, u, temperature, top_k, top_p)
                total_differ += differ
    assert total_differ <= 2                          # boundary hits are rare, not a pattern


def test_every_uniform_of_a_grid_draws_the_reference_token():
    """Uniforms in steps of 1/4096 over one row with top-k and top-p: every draw is the
    reference's (or a boundary hit)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0, 2.0, float("-inf"), 0.0, 1.5]])
    u = ((torch.arange(4096, dtype=torch.float64) + 0.5) / 4096)
    for t, k, p in ((1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.9)):
        x = logits.expand(4096, -1).contiguous()
        assert_same_draws(x, u, t, k, p)


@pytest.mark.parametrize("top_k, top_p, kept", [
    (2, 1.0, {1, 2, 3}),            # ties with the k-th stay: 2.0 at ids 1, 2 and 3
    (0, 0.3, {1}),                  # the top token alone (ties by lower id: id 1 first)
    (0, 0.7, {1, 2, 3}),            # each 2.0 holds ~0.29 of the mass: three reach 0.7
    (1, 1.0, {1, 2, 3}),
    (5, 1.0, {0, 1, 2, 3, 4}),      # k = V
])
def test_top_k_ties_and_the_nucleus_keep_what_the_reference_keeps(top_k, top_p, kept):
    logits = torch.tensor([0.0, 2.0, 2.0, 2.0, -1.0])
    u = (torch.arange(2000, dtype=torch.float64) + 0.5) / 2000
    got, _ = ops.sample_tokens(logits.expand(2000, -1), u, 1.0, top_k, top_p)
    assert set(got.tolist()) == kept


def test_uniform_zero_and_near_one_take_the_first_and_last_tokens_with_mass():
    logits = torch.tensor([[float("-inf"), float("-inf"), 1.0, 0.0, float("-inf")]] * 2)
    u = torch.tensor([0.0, 1.0 - 2.0 ** -53], dtype=torch.float64)
    got, ok = ops.sample_tokens(logits, u, 1.0)
    assert got.tolist() == [2, 3] and ok.all()
    got, _ = ops.sample_tokens(logits, u, 1.0, 0, 0.5)      # the nucleus is token 2 alone
    assert got.tolist() == [2, 2]


def test_rows_that_are_not_distributions_are_flagged_beside_valid_ones():
    logits = torch.randn(5, 100)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = float("-inf")
    logits[4, :50] = float("-inf")                            # valid: half the tokens have mass
    u = torch.full((5,), 0.5, dtype=torch.float64)
    got, ok = ops.sample_tokens(logits, u, 0.8, 0, 0.9)
    assert ok.tolist() == [True, False, False, False, True]
    assert int(got[4]) >= 50
    assert torch.equal(reference(logits, u, 0.8, 0, 0.9)[1], ok)
    with pytest.raises(ValueError, match="request 1 is not valid"):
        draw(logits, SamplingParams(temperature=0.8, top_p=0.9), u)


def test_leading_dimensions_strides_and_many_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 700, generator=g)
    u = torch.rand(2, 3, generator=g, dtype=torch.float64)
    got, _ = assert_same_draws(x, u, 0.8, 0, 0.95)
    assert got.shape == (2, 3)
    t = torch.randn(300, 40, generator=g).t()                 # a strided view: the op copies it
    assert_same_draws(t, torch.rand(40, generator=g, dtype=torch.float64), 1.0, 5)
    big = torch.randn(24, 49152, generator=g) * 4               # enough rows to split over threads
    assert_same_draws(big, torch.rand(24, generator=g, dtype=torch.float64), 0.8, 0, 0.95)
    empty = ops.sample_tokens(torch.empty(0, 9), torch.empty(0, dtype=torch.float64), 1.0)
    assert empty[0].shape == (0,) and empty[1].shape == (0,)


def test_draw_rows_takes_the_op_on_cpu_and_the_composed_path_elsewhere():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 300, generator=g) * 3
    u = torch.rand(8, generator=g, dtype=torch.float64)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9)
    assert torch.equal(draw_rows(x, params, u)[0], ops.sample_tokens(x, u, 0.9, 40, 0.9)[0])
    # float64 logits (no op path): the composed path, exactly
    x64 = x.double()
    assert torch.equal(draw_rows(x64, params, u)[0], sample_rows(processed_probs(x64, params), u)[0])


_ISA_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from heterospec import ops
from test_sample_op import rows
out = []
for V in (5, 63, 65, 1000, 49152):
    for dtype in (torch.float32, torch.bfloat16):
        x, u = rows(V + 1, 4, V, dtype)
        for t, k, p in ((0.8, 0, 1.0), (1.0, 20, 0.9), (0.5, 0, 0.95)):
            out.append(ops.sample_tokens(x, u, t, k, p))
torch.save(out, sys.argv[1])
"""


def test_every_instruction_set_path_draws_the_same_tokens(tmp_path):
    """The vector and scalar paths round differently (their exp and sums), so they agree where a
    uniform is not within rounding of a boundary: on these rows, everywhere."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    results = run_on_each_isa(_ISA_SCRIPT, tmp_path, here)
    native = results.pop("native")
    for name, got in results.items():
        for (a, ok_a), (b, ok_b) in zip(got, native):
            assert torch.equal(ok_a, ok_b), name
            assert torch.equal(a, b), name


@pytest.mark.parametrize("args, match", [
    ((torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, dtype=torch.float64), 1.0), "float32 or bfloat16"),
    ((torch.zeros(3, 0), torch.zeros(3, dtype=torch.float64), 1.0), "V >= 1"),
    ((torch.zeros(3, 4), torch.zeros(3), 1.0), "float64"),
    ((torch.zeros(3, 4), torch.zeros(4, dtype=torch.float64), 1.0), r"shape logits.shape\[:-1\]"),
    ((torch.zeros(3, 4), torch.zeros(3, dtype=torch.float64), 0.0), "temperature > 0"),
    ((torch.zeros(3, 4), torch.zeros(3, dtype=torch.float64), float("nan")), "temperature > 0"),
    ((torch.zeros(3, 4), torch.zeros(3, dtype=torch.float64), 1.0, -1), "top_k"),
    ((torch.zeros(3, 4), torch.zeros(3, dtype=torch.float64), 1.0, 2.5), "top_k"),
    ((torch.zeros(3, 4), torch.zeros(3, dtype=torch.float64), 1.0, 0, 0.0), "top_p"),
    ((torch.zeros(3, 4), torch.zeros(3, dtype=torch.float64), 1.0, 0, 1.5), "top_p"),
    ((torch.zeros(3, 4, device="meta"), torch.zeros(3, dtype=torch.float64, device="meta"), 1.0), "on the CPU"),
    (([1.0], torch.zeros(1, dtype=torch.float64), 1.0), "a tensor"),
])
def test_bad_input_is_a_clear_error(args, match):
    with pytest.raises(ValueError, match=match):
        ops.sample_tokens(*args)


def test_the_raw_op_checks_too():
    raw = torch.ops.heterospec.sample_tokens.default
    x, u = torch.randn(2, 9), torch.tensor([0.2, 0.7], dtype=torch.float64)
    for args, match in (((x.int(), u, 1.0, 0, 1.0), "float32 or bfloat16"),
                        ((x, u.float(), 1.0, 0, 1.0), "float64"),
                        ((x, u[:1], 1.0, 0, 1.0), "shape"),
                        ((x, u, -1.0, 0, 1.0), "temperature"),
                        ((x, u, 1.0, -2, 1.0), "top_k"),
                        ((x, u, 1.0, 0, 2.0), "top_p"),
                        ((x, torch.tensor([0.2, 1.0], dtype=torch.float64), 1.0, 0, 1.0), r"\[0, 1\)"),
                        ((x, torch.tensor([math.nan, 0.5], dtype=torch.float64), 1.0, 0, 1.0), r"\[0, 1\)")):
        with pytest.raises((ValueError, RuntimeError), match=match):
            raw(*args)
    tokens, ok = raw(x, u, 1.0, 0, 1.0)
    assert torch.equal(tokens, reference(x, u, 1.0)[0]) and ok.all()
