"""stream_linear_pack / stream_linear (CPU) vs their references: layout, products, the row
invariance the kernel promises, every instruction-set path, and clear errors."""

import pytest
import torch

import heterospec.ops as ops
from isa_util import run_on_each_isa
from reference import stream_linear_pack_ref, stream_linear_ref

raw = torch.ops.heterospec


@pytest.mark.parametrize("N,K", [(1, 1), (31, 5), (32, 64), (33, 7), (576, 576), (100, 0), (0, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_matches_reference_layout(N, K, dtype):
    w = torch.randn(N, K).to(dtype)
    got = ops.stream_linear_pack(w)
    assert got.shape == (max(0, -(-N // 32)), K, 32) and got.dtype == dtype
    assert torch.equal(got, stream_linear_pack_ref(w))
    assert torch.equal(ops.stream_linear_pack(w.T.contiguous().T), got)        # any strides


@pytest.mark.parametrize("N,K", [(1, 1), (33, 7), (96, 64), (192, 576), (576, 1536), (2000, 100)])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_reference(N, K, M, bias):
    g = torch.Generator().manual_seed(N * 7 + K * 3 + M)
    w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    got = ops.stream_linear(x, ops.stream_linear_pack(w), b, N)
    torch.testing.assert_close(got, stream_linear_ref(x, w, b), rtol=1e-5, atol=1e-5 * max(1, K) ** 0.5)


@pytest.mark.parametrize("N,K", [(1, 1), (33, 7), (192, 576), (576, 1536)])
@pytest.mark.parametrize("M", [1, 3, 8, 13])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_products_match_reference(N, K, M, bias):
    """bfloat16 weights and inputs: float32 sums of exact products, rounded once (so within a
    bf16 rounding of the exact value)."""
    g = torch.Generator().manual_seed(N * 5 + K + M)
    w, x = torch.randn(N, K, generator=g).bfloat16(), torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    got = ops.stream_linear(x, ops.stream_linear_pack(w), b, N)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    assert ((got.double() - exact).abs() <= 2 ** -7 * exact.abs() + 1e-4 * max(1, K) ** 0.5).all()
    f32 = ops.stream_linear(x.float(), ops.stream_linear_pack(w.float()), b.float() if bias else None, N)
    assert torch.equal(got, f32.bfloat16())       # the float32 chain of the same values, rounded once


@pytest.mark.parametrize("shape", [(0, 64), (2, 3, 64), (1, 1, 1, 64), (64,)])
def test_leading_dimensions_are_kept(shape):
    w = torch.randn(40, 64)
    x = torch.randn(*shape)
    got = ops.stream_linear(x, ops.stream_linear_pack(w), None, 40)
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, stream_linear_ref(x.reshape(-1, 64), w).reshape(*shape[:-1], 40),
                               rtol=1e-5, atol=1e-4)


def test_zero_inner_dimension_gives_the_bias():
    b = torch.randn(5)
    got = ops.stream_linear(torch.randn(3, 0), ops.stream_linear_pack(torch.randn(5, 0)), b, 5)
    assert torch.equal(got, b.expand(3, 5))


@pytest.mark.parametrize("N,K", [(33, 7), (576, 576), (49, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(N, K, dtype):
    """One FMA chain per output: a tree verify gives each token what a one-token step would."""
    g = torch.Generator().manual_seed(K)
    w, x, b = (torch.randn(N, K, generator=g).to(dtype), torch.randn(24, K, generator=g).to(dtype),
               torch.randn(N, generator=g).to(dtype))
    p = ops.stream_linear_pack(w)
    alone = torch.cat([ops.stream_linear(x[i:i + 1], p, b, N) for i in range(24)])
    for M in (2, 3, 7, 8, 9, 16, 24):
        assert torch.equal(ops.stream_linear(x[:M], p, b, N), alone[:M]), M
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = ops.stream_linear(x, p, b, N)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, alone)


_PATHS_SCRIPT = """
import sys, torch, heterospec.ops as ops
g = torch.Generator().manual_seed(0)
out = []
for N, K in ((33, 7), (576, 576), (100, 1536)):
    w, x, b = torch.randn(N, K, generator=g), torch.randn(11, K, generator=g), torch.randn(N, generator=g)
    out.append(ops.stream_linear(x, ops.stream_linear_pack(w), b, N))
    out.append(ops.stream_linear(x, ops.stream_linear_pack(w.half()), b, N))
    w, x, b = w.bfloat16(), x.bfloat16(), b.bfloat16()
    out.append(ops.stream_linear(x, ops.stream_linear_pack(w), b, N))
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX"),
                    reason="x86 only: the portable loop is already the default here")
def test_every_instruction_set_path_computes_the_same_bits(tmp_path):
    """The AVX-512, AVX2 (also what an emulated AVX2 CPU runs) and portable paths (read once per
    process) run the same FMA chains, so they agree bit for bit, and with the reference."""
    results = run_on_each_isa(_PATHS_SCRIPT, tmp_path)
    g = torch.Generator().manual_seed(0)
    for i, (N, K) in enumerate(((33, 7), (576, 576), (100, 1536))):
        w, x, b = torch.randn(N, K, generator=g), torch.randn(11, K, generator=g), torch.randn(N, generator=g)
        torch.testing.assert_close(results["native"][3 * i], stream_linear_ref(x, w, b), rtol=1e-5, atol=1e-4)
        for j in (3 * i, 3 * i + 1, 3 * i + 2):     # float32, float16 weights, bfloat16
            assert torch.equal(results["avx2"][j], results["native"][j]), (N, K, j)
            assert torch.equal(results["scalar"][j], results["native"][j]), (N, K, j)


@pytest.mark.parametrize("N,K", [(1, 1), (33, 7), (192, 576), (576, 1536)])
@pytest.mark.parametrize("M", [1, 3, 8, 13])
def test_float16_weights_give_the_float32_bits_of_their_values(N, K, M):
    """A float32 weight holding float16 values (a float16 checkpoint loaded in float32) streams as
    float16: the same float32 chain over the same values, half the bytes."""
    g = torch.Generator().manual_seed(N + K + M)
    w, x, b = torch.randn(N, K, generator=g).half(), torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    packed = ops.stream_linear_pack(w)
    assert packed.dtype == torch.float16 and torch.equal(packed.float(), ops.stream_linear_pack(w.float()))
    got = ops.stream_linear(x, packed, b, N)
    assert got.dtype == torch.float32
    assert torch.equal(got, ops.stream_linear(x, ops.stream_linear_pack(w.float()), b, N))


def _errors(fn):
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


@pytest.mark.parametrize("call", ["wrapper", "raw"])
def test_bad_input_gets_a_clear_error(call):
    api = ops if call == "wrapper" else None
    pack = (lambda w: ops.stream_linear_pack(w)) if api else (lambda w: raw.stream_linear_pack(w))
    lin = (lambda *a: ops.stream_linear(*a)) if api else (lambda *a: raw.stream_linear(*a))
    w = torch.randn(40, 16)
    p = ops.stream_linear_pack(w)
    x = torch.randn(3, 16)
    assert "weight" in _errors(lambda: pack(w.double())) and "float16" in _errors(lambda: pack(w.int()))
    assert "packed_weight of dtype torch.bfloat16" in _errors(lambda: lin(x.bfloat16(), p.half(), None, 40))
    assert "packed_weight of dtype torch.float32" in _errors(lambda: lin(x, p.bfloat16(), None, 40))
    assert "bias of dtype torch.bfloat16" in _errors(lambda: lin(x.bfloat16(), p.bfloat16(), torch.randn(40), 40))
    assert "[N, K]" in _errors(lambda: pack(torch.randn(2, 3, 4)))
    assert "dtype" in _errors(lambda: lin(x.double(), p, None, 40))
    assert "x" in _errors(lambda: lin(torch.tensor(1.0), p, None, 40))
    assert "packed_weight" in _errors(lambda: lin(x, w, None, 40))
    assert "K = packed_weight.size(1)" in _errors(lambda: lin(torch.randn(3, 15), p, None, 40))
    msg = _errors(lambda: lin(x, p, None, 65))
    assert "out_features" in msg and "32 < out_features <= 64" in msg
    assert "out_features" in _errors(lambda: lin(x, p, None, 32))
    assert "bias" in _errors(lambda: lin(x, p, torch.randn(39), 40))
    assert "bias" in _errors(lambda: lin(x, p, torch.randn(40).double(), 40))
    assert "packed_weight" in _errors(lambda: lin(x, torch.randn(2, 16, 16), None, 40))


def test_the_wrapper_names_the_device_for_a_gpu_tensor():
    w = torch.randn(8, 4, device="meta")
    assert "CPU" in _errors(lambda: ops.stream_linear_pack(w))
    assert "CPU" in _errors(lambda: ops.stream_linear(torch.randn(2, 4, device="meta"),
                                                       torch.randn(1, 4, 32, device="meta"), None, 8))


def test_q8_0_values_are_a_q8_0_file_s_values():
    """q8_0_values rounds a weight to what a GGUF Q8_0 file holds: stream_linear_pack_blocks finds
    its codes, each value within half a step of the original, and a width not a multiple of 32 is
    refused."""
    from heterospec.models.linear import q8_0_values
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g) * 0.05
    w[3, :32] = 0                                   # an all-zero group
    v = q8_0_values(w)
    found = ops.stream_linear_pack_blocks(v)
    assert found is not None and found[0] == "q8_0"
    step = (w.reshape(96, 4, 32).abs().amax(-1) / 127).repeat_interleave(32, dim=1)
    assert bool(((v - w).abs() <= 0.5 * step * (1 + 2e-3) + 1e-12).all()) and not torch.equal(v, w)
    assert torch.equal(q8_0_values(v), v) and torch.equal(v[3, :32], torch.zeros(32))
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0_values(torch.randn(4, 40))
