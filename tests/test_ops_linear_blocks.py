"""stream_linear_pack_blocks / stream_linear_blocks (CPU): a float32 weight that holds a GGUF Q4_1
or Q8_0 file's values streams as its codes and gives stream_linear's outputs bit for bit, on
every instruction-set path (with a bfloat16 x: stream_linear's on the weight cast to bfloat16);
weights without such codes are left alone; clear errors."""

import os

import pytest
import torch

import heterospec.ops as ops
from isa_util import run_on_each_isa
from reference import (blocks_layout_ref, quantize_q4_1_ref, quantize_q8_0_ref, stream_linear_ref)

raw = torch.ops.heterospec


def _q4(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_q4_1_ref(torch.randn(N, K, generator=g) * 0.05)


def _q8(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_q8_0_ref(torch.randn(N, K, generator=g) * 0.05)


@pytest.mark.parametrize("N,K", [(1, 32), (31, 64), (32, 32), (33, 96), (70, 576)])
def test_the_packer_finds_q4_1_codes_and_lays_them_out(N, K):
    w, q, d, m = _q4(N, K, seed=N + K)
    found = ops.stream_linear_pack_blocks(w)
    assert found is not None and found[0] == "q4_1"
    _, codes, scales = found
    P = -(-N // 32)
    assert codes.shape == (P, K, 16) and codes.dtype == torch.uint8
    assert scales.shape == (P, K // 32, 2, 32) and scales.dtype == torch.float32
    want_codes, want_scales = blocks_layout_ref(q, d, m, "q4_1")
    # a group's codes are the quantiser's: the recovered ones stand for the same weights
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)


@pytest.mark.parametrize("N,K", [(1, 32), (40, 64), (96, 576)])
def test_the_packer_finds_q8_0_codes_and_lays_them_out(N, K):
    w, q, d = _q8(N, K, seed=N * K)
    found = ops.stream_linear_pack_blocks(w)
    assert found is not None and found[0] == "q8_0"
    want_codes, want_scales = blocks_layout_ref(q, d, None, "q8_0")
    assert torch.equal(found[1], want_codes) and torch.equal(found[2], want_scales)
    assert ops.stream_linear_pack_blocks(w, formats=("q4_1",)) is None      # not Q4_1 values


def test_weights_without_exact_codes_are_left_alone():
    g = torch.Generator().manual_seed(1)
    assert ops.stream_linear_pack_blocks(torch.randn(64, 64, generator=g)) is None     # trained / random
    w = _q4(64, 64)[0]
    assert ops.stream_linear_pack_blocks(w[:, :48].contiguous()) is None   # K not a multiple of 32
    bent = w.clone()
    bent[40, 3] = torch.nextafter(bent[40, 3], torch.tensor(1.0))          # one weight off by an ulp
    assert ops.stream_linear_pack_blocks(bent) is None
    nan = w.clone()
    nan[0, 0] = float("nan")
    assert ops.stream_linear_pack_blocks(nan) is None
    assert ops.stream_linear_pack_blocks(torch.zeros(0, 64)) is None
    zero = torch.zeros(32, 64)                                              # d = 0: all codes 0
    found = ops.stream_linear_pack_blocks(zero)
    assert found is not None and not found[2].any()


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("N,K", [(1, 32), (33, 64), (96, 576), (576, 1536), (200, 96)])
@pytest.mark.parametrize("M", [1, 2, 3, 8, 13, 25])
@pytest.mark.parametrize("bias", [False, True])
def test_products_equal_stream_linear_on_the_float_weight_bit_for_bit(fmt, N, K, M, bias):
    w = (_q4 if fmt == "q4_1" else _q8)(N, K, seed=N + 3 * K)[0]
    g = torch.Generator().manual_seed(M + N)
    x = torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    _, codes, scales = ops.stream_linear_pack_blocks(w)
    got = ops.stream_linear_blocks(x, codes, scales, b, N)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    assert torch.equal(got, ops.stream_linear(x, ops.stream_linear_pack(w), b, N))
    torch.testing.assert_close(got, stream_linear_ref(x, w, b), rtol=1e-5, atol=1e-5 * K ** 0.5)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("N,K", [(1, 32), (33, 64), (96, 576), (576, 1536)])
@pytest.mark.parametrize("M", [1, 2, 3, 13])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_products_equal_stream_linear_on_the_bfloat16_weight_bit_for_bit(fmt, N, K, M, bias):
    """A bfloat16 x takes the weight as a bfloat16 model holds it (the float32 weight cast,
    rounded to nearest even): the codes give stream_linear's bfloat16 bits from 4 or 8 bits a
    weight, and the pure-PyTorch reference within bfloat16 rounding."""
    w = (_q4 if fmt == "q4_1" else _q8)(N, K, seed=N + 5 * K)[0]
    g = torch.Generator().manual_seed(M + N + 1)
    x = torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    _, codes, scales = ops.stream_linear_pack_blocks(w)
    got = ops.stream_linear_blocks(x, codes, scales, b, N)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    wb = w.bfloat16()
    assert torch.equal(got, ops.stream_linear(x, ops.stream_linear_pack(wb), b, N))
    want = stream_linear_ref(x.float(), wb.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    # weights off their bfloat16 values would show: the float32 weight's products differ
    assert not torch.equal(got, ops.stream_linear_blocks(x.float(), codes, scales, None if b is None else b.float(),
                                                         N).bfloat16()) or N * K < 64


@pytest.mark.parametrize("shape", [(0, 64), (2, 3, 64), (64,)])
def test_leading_dimensions_are_kept(shape):
    w = _q4(40, 64)[0]
    _, codes, scales = ops.stream_linear_pack_blocks(w)
    x = torch.randn(*shape)
    got = ops.stream_linear_blocks(x, codes, scales, None, 40)
    assert got.shape == (*shape[:-1], 40)
    assert torch.equal(got, ops.stream_linear(x, ops.stream_linear_pack(w), None, 40))


@pytest.mark.parametrize("quant", ["q4_1", "q8_0"])
@pytest.mark.parametrize("N", [96, 40, 56])   # whole blocks; a last block of 8 and of 24 outputs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(quant, N, dtype):
    """1-2 rows take the whole block in one pass on AVX2, more rows half a block per pass, more
    than one chunk of rows (AVX2: 6, AVX-512: 12) a buffer of widened codes, 96 rows at a time:
    the same chains, the same bits."""
    w = (_q4 if quant == "q4_1" else _q8)(N, 576, seed=5)[0]
    _, codes, scales = ops.stream_linear_pack_blocks(w)
    x = torch.randn(100, 576).to(dtype)
    alone = torch.cat([ops.stream_linear_blocks(x[i:i + 1], codes, scales, None, N) for i in range(100)])
    for M in (2, 3, 7, 12, 13, 24, 97):
        assert torch.equal(ops.stream_linear_blocks(x[:M], codes, scales, None, N), alone[:M]), M
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(ops.stream_linear_blocks(x, codes, scales, None, N), alone)
    finally:
        torch.set_num_threads(threads)


_PATHS_SCRIPT = """
import sys, torch, heterospec.ops as ops
sys.path.insert(0, sys.argv[2])
from reference import quantize_q4_1_ref, quantize_q8_0_ref
g = torch.Generator().manual_seed(0)
out = []
for N, K in ((33, 64), (576, 576), (100, 1536)):
    for quant in (quantize_q4_1_ref, quantize_q8_0_ref):
        w = quant(torch.randn(N, K, generator=g) * 0.05)[0]
        x, b = torch.randn(11 if K > 64 else 101, K, generator=g), torch.randn(N, generator=g)
        _, codes, scales = ops.stream_linear_pack_blocks(w)
        out.append((ops.stream_linear_blocks(x, codes, scales, b, N), ops.stream_linear(x, ops.stream_linear_pack(w), b, N)))
        xb, bb = x.bfloat16(), b.bfloat16()
        out.append((ops.stream_linear_blocks(xb, codes, scales, bb, N),
                    ops.stream_linear(xb, ops.stream_linear_pack(w.bfloat16()), bb, N)))
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX"),
                    reason="x86 only: the portable loop is already the default here")
def test_every_instruction_set_path_computes_the_same_bits(tmp_path):
    """AVX-512, AVX2 (what an emulated AVX2 CPU runs) and the portable loop widen the codes to the
    same weights and run the same chains: equal to each other and to stream_linear's bits."""
    results = run_on_each_isa(_PATHS_SCRIPT, tmp_path, os.path.dirname(os.path.abspath(__file__)))
    for i, (blocks, floats) in enumerate(results["native"]):
        assert torch.equal(blocks, floats), i
        for name in ("avx2", "scalar"):
            assert torch.equal(results[name][i][0], blocks), (name, i)


_SMALL_ROWS_SCRIPT = """
import sys, torch, heterospec.ops as ops
sys.path.insert(0, sys.argv[2])
from reference import quantize_q4_1_ref, quantize_q8_0_ref
g = torch.Generator().manual_seed(1)
out = []
for N, K in ((33, 64), (100, 1536)):
    for quant in (quantize_q4_1_ref, quantize_q8_0_ref):
        w = quant(torch.randn(N, K, generator=g) * 0.05)[0]
        x, b = torch.randn(5, K, generator=g), torch.randn(N, generator=g)
        _, codes, scales = ops.stream_linear_pack_blocks(w)
        out.append([ops.stream_linear_blocks(x[:m], codes, scales, b, N) for m in (1, 2, 5)])
        out.append([ops.stream_linear_blocks(x[:m].bfloat16(), codes, scales, b.bfloat16(), N) for m in (1, 2, 5)])
torch.save(out, sys.argv[1])
"""


def _has_avx512():
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx512(), reason="the small-row kernel choice exists on AVX-512 CPUs only")
def test_one_and_two_rows_get_the_same_bits_with_either_small_row_kernels(tmp_path):
    """On an AVX-512 CPU 1-2 rows run the AVX-512 or the AVX2 one-pass kernels (whichever was
    measured faster, or HETEROSPEC_SMALL_ROWS_ISA): both give the bits of the rows in a 5-row
    (AVX-512) call."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    got = {}
    for isa in ("avx512", "avx2", ""):
        env = {k: v for k, v in os.environ.items() if k not in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                                                               "HETEROSPEC_CPU_SCALAR", "HETEROSPEC_SMALL_ROWS_ISA")}
        if isa:
            env["HETEROSPEC_SMALL_ROWS_ISA"] = isa
        path = tmp_path / f"{isa or 'measured'}.pt"
        run = subprocess.run([sys.executable, "-c", _SMALL_ROWS_SCRIPT, str(path), here], env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        got[isa] = torch.load(path)
    for i, (one, two, five) in enumerate(got["avx512"]):
        assert torch.equal(one, five[:1]) and torch.equal(two, five[:2]), i
        for isa in ("avx2", ""):
            assert all(torch.equal(a, b) for a, b in zip(got[isa][i], (one, two, five))), (isa, i)


def _errors(fn):
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


@pytest.mark.parametrize("call", ["wrapper", "raw"])
def test_bad_input_gets_a_clear_error(call):
    lin = ops.stream_linear_blocks if call == "wrapper" else raw.stream_linear_blocks
    _, codes, scales = ops.stream_linear_pack_blocks(_q4(40, 64)[0])
    _, codes8, scales8 = ops.stream_linear_pack_blocks(_q8(40, 64)[0])
    x = torch.randn(3, 64)
    assert "x" in _errors(lambda: lin(x.half(), codes, scales, None, 40))
    assert "x" in _errors(lambda: lin(torch.tensor(1.0), codes, scales, None, 40))
    assert "codes" in _errors(lambda: lin(x, codes.to(torch.int16), scales, None, 40))
    assert "codes" in _errors(lambda: lin(x, codes[:, :, :8], scales, None, 40))
    assert "codes" in _errors(lambda: lin(x, codes8.view(torch.uint8), scales8, None, 40))     # Q8 bytes as Q4_1
    assert "K = codes.size(1)" in _errors(lambda: lin(torch.randn(3, 32), codes, scales, None, 40))
    assert "scales" in _errors(lambda: lin(x, codes, scales.double(), None, 40))
    assert "scales" in _errors(lambda: lin(x, codes, scales[:, :1], None, 40))
    assert "scales" in _errors(lambda: lin(x, codes, scales[:1], None, 40))
    msg = _errors(lambda: lin(x, codes, scales, None, 65))
    assert "out_features" in msg and "32 < out_features <= 64" in msg
    assert "bias" in _errors(lambda: lin(x, codes, scales, torch.randn(39), 40))
    assert "bias" in _errors(lambda: lin(x, codes, scales, torch.randn(40).double(), 40))
    assert "bias" in _errors(lambda: lin(x.bfloat16(), codes, scales, torch.randn(40), 40))   # not x's dtype
    odd = torch.zeros(2, 48, 16, dtype=torch.uint8)
    assert "multiple of 32" in _errors(lambda: raw.stream_linear_blocks(torch.randn(1, 48), odd,
                                                                       torch.zeros(2, 1, 2, 32), None, 40))
    assert lin(x, codes8, scales8, None, 40).shape == (3, 40)            # int8 codes are Q8_0


def test_the_packer_and_the_wrapper_name_what_is_wrong():
    assert "weight" in _errors(lambda: ops.stream_linear_pack_blocks(torch.randn(4, 32).double()))
    assert "[N, K]" in _errors(lambda: ops.stream_linear_pack_blocks(torch.randn(2, 3, 32)))
    assert "unknown format" in _errors(lambda: ops.stream_linear_pack_blocks(torch.randn(4, 32), formats=("q5_0",)))
    assert "CPU" in _errors(lambda: ops.stream_linear_pack_blocks(torch.randn(8, 32, device="meta")))
    assert "CPU" in _errors(lambda: ops.stream_linear_blocks(torch.randn(2, 32, device="meta"),
                                                             torch.zeros(1, 32, 16, dtype=torch.uint8, device="meta"),
                                                             torch.zeros(1, 1, 2, 32, device="meta"), None, 8))
