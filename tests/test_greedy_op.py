"""greedy_tokens (op 16): the greedy pick against its pure-PyTorch reference, torch.argmax."""

import pytest
import torch

from heterospec import ops
from heterospec.sampling import greedy_tokens as sampling_greedy
from isa_util import run_on_each_isa


def reference(logits: torch.Tensor) -> torch.Tensor:
    """The first index of the maximum over the last dimension; a NaN counts as the maximum."""
    return logits.float().argmax(dim=-1)


def cases(seed: int = 0):
    """Rows that exercise every branch: vector bodies and scalar tails (V around multiples of 8,
    16 and 32), ties, NaN, +-inf, all -inf, signed zeros, float32 and bfloat16."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for V in (1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 257, 4099):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(6, V, generator=g).to(dtype)
            x[1] = (x[1] * 2).round()                                  # many ties
            x[2, int(torch.randint(0, V, (1,), generator=g))] = float("nan")
            if V > 3:
                x[2, V - 1] = float("nan")                              # two NaNs: the first counts
            x[3] = float("-inf")                                         # no finite logit: index 0
            x[4, int(torch.randint(0, V, (1,), generator=g))] = float("inf")
            x[5] = 0.0
            if V > 1:
                x[5, V // 2:] = -0.0 if V % 2 else 0.0                    # -0.0 == 0.0: the first zero
                x[5, 0] = -0.0
            out.append(x)
    return out


def test_matches_argmax_on_every_row_kind():
    for x in cases():
        assert torch.equal(ops.greedy_tokens(x), reference(x)), (x.dtype, x.shape)
        assert torch.equal(sampling_greedy(x), reference(x))


def test_leading_dimensions_strides_and_many_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 700, generator=g)
    assert torch.equal(ops.greedy_tokens(x), reference(x))
    # a strided view (not contiguous in its rows): the wrapper and the op copy it
    t = torch.randn(300, 40, generator=g).t()
    assert not t.is_contiguous()
    assert torch.equal(ops.greedy_tokens(t), reference(t))
    # enough rows of a large vocabulary for the rows to split over threads
    big = torch.randn(48, 49152, generator=g).to(torch.bfloat16)
    assert torch.equal(ops.greedy_tokens(big), reference(big))
    # no rows
    assert ops.greedy_tokens(torch.empty(0, 9)).shape == (0,)


_ISA_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from heterospec import ops
from test_greedy_op import cases
torch.save([ops.greedy_tokens(x) for x in cases(3)], sys.argv[1])
"""


def test_every_instruction_set_path_matches(tmp_path):
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    results = run_on_each_isa(_ISA_SCRIPT, tmp_path, here)
    want = [reference(x) for x in cases(3)]
    for name, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(3, 4, dtype=torch.int64), "float32 or bfloat16"),
    (torch.zeros(3, 4, dtype=torch.float16), "float32 or bfloat16"),
    (torch.zeros(3, 0), "V >= 1"),
    (torch.tensor(1.0), "V >= 1"),
    (torch.zeros(3, 4, device="meta"), "on the CPU"),
    ([1.0, 2.0], "a tensor"),
])
def test_bad_input_is_a_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        ops.greedy_tokens(bad)


def test_the_raw_op_checks_too():
    raw = torch.ops.heterospec.greedy_tokens.default
    for bad, match in ((torch.zeros(2, 3, dtype=torch.int32), "float32 or bfloat16"),
                       (torch.tensor(1.0), "0-dimensional"), (torch.zeros(2, 0), "V >= 1")):
        with pytest.raises((ValueError, RuntimeError), match=match):
            raw(bad)
    # leading dimensions are the op's own: [..., V] -> [...], one row -> a 0-dimensional index
    x = torch.randn(2, 3, 40)
    assert torch.equal(raw(x), reference(x))
    assert raw(x[0, 0]).shape == () and int(raw(x[0, 0])) == int(reference(x[0, 0]))


def test_sampling_falls_back_where_the_op_does_not_serve():
    x = torch.randn(4, 50, dtype=torch.float64)
    x[1, 7] = float("nan")
    assert torch.equal(sampling_greedy(x), x.argmax(dim=-1))
    h = torch.randn(3, 33).half()
    assert torch.equal(sampling_greedy(h), h.float().argmax(dim=-1))
