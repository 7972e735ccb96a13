"""rms_norm / rope / rope_kv_write_ (CPU) vs their references: values in every float dtype, any strides, the row
invariance they promise, the models' use of them, and clear errors."""

import pytest
import torch

import heterospec.ops as ops
from reference import rms_norm_ref, rope_kv_write_ref, rope_ref
from test_ops_linear import _errors

raw = torch.ops.heterospec
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tables(B, T, D, dtype, gen, scaling=1.0):
    ang = torch.rand(B, T, D // 2, generator=gen) * 200
    emb = torch.cat((ang, ang), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 7, 576), (5, 64), (2, 2, 2, 3), (1,)])
def test_rms_norm_matches_reference(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    got = ops.rms_norm(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    ref = rms_norm_ref(x, w, 1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6)
    else:   # the same float32 math, one cast, one rounded product: the reference's bits
        assert torch.equal(got, ref)


def test_rms_norm_close_to_torch_and_exact_on_a_constant_row():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 576, generator=g), torch.randn(576, generator=g)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (576,), w, 1e-6),
                               rtol=2e-6, atol=1e-6)
    row = torch.full((1, 64), 2.0)
    assert torch.equal(ops.rms_norm(row, torch.ones(64), 0.0), torch.ones(1, 64))   # 2 / sqrt(4)


def test_rms_norm_any_strides_and_empty():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(6, 130, generator=g), torch.randn(65, generator=g)
    strided = x[:, ::2]                                       # last-dim stride 2
    assert torch.equal(ops.rms_norm(strided, w, 1e-5), ops.rms_norm(strided.contiguous(), w, 1e-5))
    assert torch.equal(ops.rms_norm(x.T.contiguous().T[:, :65], w, 1e-5), ops.rms_norm(x[:, :65].contiguous(), w, 1e-5))
    assert ops.rms_norm(torch.randn(0, 8), torch.randn(8), 1e-5).shape == (0, 8)
    assert ops.rms_norm(torch.randn(3, 0), torch.randn(0), 1e-5).shape == (3, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,Hq,Hk,D", [(1, 1, 9, 3, 64), (2, 5, 4, 4, 8), (3, 8, 2, 1, 2), (1, 300, 9, 3, 64)])
def test_rope_is_the_formula_bit_for_bit(dtype, B, T, Hq, Hk, D):
    g = torch.Generator().manual_seed(B * 100 + T * 10 + D)
    q, k = torch.randn(B, T, Hq, D, generator=g).to(dtype), torch.randn(B, T, Hk, D, generator=g).to(dtype)
    cos, sin = _tables(B, T, D, dtype, g, scaling=1.3)
    q_out, k_out = ops.rope(q, k, cos, sin)
    assert q_out.is_contiguous() and k_out.is_contiguous() and q_out.dtype == dtype
    assert torch.equal(q_out, rope_ref(q, cos, sin))
    assert torch.equal(k_out, rope_ref(k, cos, sin))


def test_rope_matches_the_models_formula_on_views_of_one_projection():
    """The attention block hands over Q and K as views of one fused projection output."""
    from heterospec.models.layers import apply_rope

    g = torch.Generator().manual_seed(3)
    B, T, Hq, Hk, D = 2, 6, 9, 3, 64
    fused = torch.randn(B, T, (Hq + 2 * Hk) * D, generator=g)
    q, k, _ = fused.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k = q.view(B, T, Hq, D), k.view(B, T, Hk, D)
    cos, sin = _tables(B, T, D, torch.float32, g)
    q_out, k_out = ops.rope(q, k, cos, sin)
    assert torch.equal(q_out, apply_rope(q, cos, sin)) and torch.equal(k_out, apply_rope(k, cos, sin))
    # strided tables and a last-dim stride other than 1
    wide = torch.randn(B, T, 2 * D, generator=g)
    assert torch.equal(ops.rope(q, k, wide[..., ::2], wide[..., 1::2])[0], rope_ref(q, wide[..., ::2], wide[..., 1::2]))
    qs = torch.randn(B, T, Hq, 2 * D, generator=g)[..., ::2]
    assert torch.equal(ops.rope(qs, k, cos, sin)[0], rope_ref(qs, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(dtype):
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(24, 576, generator=g).to(dtype), torch.randn(576, generator=g).to(dtype)
    alone = torch.cat([ops.rms_norm(x[i:i + 1], w, 1e-5) for i in range(24)])
    q, k = torch.randn(1, 24, 9, 64, generator=g).to(dtype), torch.randn(1, 24, 3, 64, generator=g).to(dtype)
    cos, sin = _tables(1, 24, 64, dtype, g)
    q1 = torch.cat([ops.rope(q[:, i:i + 1], k[:, i:i + 1], cos[:, i:i + 1], sin[:, i:i + 1])[0] for i in range(24)], 1)
    threads = torch.get_num_threads()
    for n in (1, threads):
        torch.set_num_threads(n)
        try:
            for M in (2, 8, 24):
                assert torch.equal(ops.rms_norm(x[:M], w, 1e-5), alone[:M]), (n, M)
                assert torch.equal(ops.rope(q[:, :M], k[:, :M], cos[:, :M], sin[:, :M])[0], q1[:, :M]), (n, M)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,Hq,Hk,D,lens", [(1, 1, 9, 3, 64, [37]), (3, 5, 4, 2, 8, [0, 9, 4]),
                                             (2, 7, 2, 2, 2, [3, 0]), (1, 300, 9, 3, 64, [10])])
def test_rope_kv_write_is_the_split_the_rope_and_the_cache_write_bit_for_bit(dtype, B, T, Hq, Hk, D, lens):
    """Q and K rotated with rope's bits, K and V at each request's slots after its prefix, every
    other slot untouched; also from a strided projection output (rows of a wider buffer)."""
    g = torch.Generator().manual_seed(B * 100 + T)
    S = max(lens) + T + 3
    wide = torch.randn(B, T, (Hq + 2 * Hk) * D + 5, generator=g).to(dtype)
    qkv = wide[..., 5:]                                      # last stride 1, row stride wider
    cos, sin = _tables(B, T, D, dtype, g)
    kc, vc = torch.randn(B, S, Hk, D, generator=g).to(dtype), torch.randn(B, S, Hk, D, generator=g).to(dtype)
    lens_t = torch.tensor(lens)
    want_q, want_k, want_v = rope_kv_write_ref(qkv, cos, sin, lens_t, kc, vc, Hq)
    q_out = torch.empty(B, T, Hq, D, dtype=dtype)
    ops.rope_kv_write_(qkv, cos, sin, lens_t, q_out, kc, vc)
    assert torch.equal(q_out, want_q) and torch.equal(kc, want_k) and torch.equal(vc, want_v)
    # one layer of a [layers, B, S, Hkv, D] cache, as the target passes it
    cache_k, cache_v = torch.zeros(2, B, S, Hk, D, dtype=dtype), torch.zeros(2, B, S, Hk, D, dtype=dtype)
    ops.rope_kv_write_(qkv, cos, sin, lens_t, q_out, cache_k[1], cache_v[1])
    _, want_k, want_v = rope_kv_write_ref(qkv, cos, sin, lens_t, torch.zeros_like(kc), torch.zeros_like(vc), Hq)
    assert torch.equal(cache_k[1], want_k) and torch.equal(cache_v[1], want_v)
    assert not cache_k[0].any() and not cache_v[0].any()


def test_the_target_writes_its_cache_and_rotates_with_one_op_and_the_same_logits(monkeypatch):
    """A streamed target forward (float32, the fused QKV call) takes rope_kv_write_, with the logits
    and cache of the path without it, bit for bit (the layer run call by call, op 13 aside)."""
    from models_util import streamed_flag_ab

    runs = streamed_flag_ab(monkeypatch, "ROPE_KV_WRITE", "rope_kv_write_", seed=7, off={"LAYER_OP": False})
    if runs is None:
        pytest.skip("the tiny model's linears do not all stream here (no streamed layers)")
    (fused, cache_f), (plain, cache_p) = runs
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert torch.equal(cache_f.k, cache_p.k) and torch.equal(cache_f.v, cache_p.v)


def test_large_inputs_split_over_threads_agree():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(4096, 576, generator=g), torch.randn(576, generator=g)
    q, k = torch.randn(2, 2048, 9, 64, generator=g), torch.randn(2, 2048, 3, 64, generator=g)
    cos, sin = _tables(2, 2048, 64, torch.float32, g)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), rtol=2e-6, atol=1e-6)
    q_out, k_out = ops.rope(q, k, cos, sin)
    assert torch.equal(q_out, rope_ref(q, cos, sin)) and torch.equal(k_out, rope_ref(k, cos, sin))


@pytest.mark.parametrize("call", ["wrapper", "raw"])
def test_bad_input_gets_a_clear_error(call):
    norm = ops.rms_norm if call == "wrapper" else (lambda *a: raw.rms_norm(*a))
    rope = ops.rope if call == "wrapper" else (lambda *a: raw.rope(*a))
    x, w = torch.randn(3, 16), torch.randn(16)
    assert "x of dtype" in _errors(lambda: norm(x.double(), w.double(), 1e-5))
    assert "weight of dtype" in _errors(lambda: norm(x, w.half(), 1e-5))
    assert "H = x.size(-1)" in _errors(lambda: norm(x, torch.randn(15), 1e-5))
    assert "[H]" in _errors(lambda: norm(x, torch.randn(1, 16), 1e-5))
    assert "0-dimensional" in _errors(lambda: norm(torch.tensor(1.0), torch.randn(0), 1e-5))
    assert "eps" in _errors(lambda: norm(x, w, -1.0))
    assert "eps" in _errors(lambda: norm(x, w, float("nan")))
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 2, 8)
    c, s = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    assert "even head size" in _errors(lambda: rope(torch.randn(1, 2, 4, 7), torch.randn(1, 2, 2, 7),
                                                     torch.randn(1, 2, 7), torch.randn(1, 2, 7)))
    assert "[B, T, Hq, D]" in _errors(lambda: rope(torch.randn(2, 4, 8), k, c, s))
    assert "k of dtype" in _errors(lambda: rope(q, k.bfloat16(), c, s))
    assert "T = q.size(1)" in _errors(lambda: rope(q, torch.randn(1, 3, 2, 8), c, s))
    assert "D = q.size(3)" in _errors(lambda: rope(q, torch.randn(1, 2, 2, 6), c, s))
    assert "cos" in _errors(lambda: rope(q, k, torch.randn(1, 2, 6), s))
    assert "sin" in _errors(lambda: rope(q, k, c, torch.randn(2, 2, 8)))
    assert "sin of dtype" in _errors(lambda: rope(q, k, c, s.half()))
    assert "q of dtype" in _errors(lambda: rope(q.long(), k.long(), c.long(), s.long()))


@pytest.mark.parametrize("call", ["wrapper", "raw"])
def test_rope_kv_write_bad_input_gets_a_clear_error(call):
    fn = ops.rope_kv_write_ if call == "wrapper" else (lambda *a: raw.rope_kv_write_(*a))
    B, T, Hq, Hk, D, S = 2, 3, 4, 2, 8, 9
    qkv, c, s = torch.randn(B, T, (Hq + 2 * Hk) * D), torch.randn(B, T, D), torch.randn(B, T, D)
    lens, q = torch.tensor([2, 6]), torch.empty(B, T, Hq, D)
    kc, vc = torch.zeros(B, S, Hk, D), torch.zeros(B, S, Hk, D)
    assert "prefix_lens[1] + T <= S" in _errors(lambda: fn(qkv, c, s, torch.tensor([2, 7]), q, kc, vc))
    assert "prefix_lens[0]" in _errors(lambda: fn(qkv, c, s, torch.tensor([-1, 0]), q, kc, vc))
    assert "(Hq + 2 Hkv) * D" in _errors(lambda: fn(torch.randn(B, T, 60), c, s, lens, q, kc, vc))
    assert "qkv of dtype" in _errors(lambda: fn(qkv.double(), c.double(), s.double(), lens, q.double(), kc.double(),
                                                vc.double()))
    assert "k_cache of dtype" in _errors(lambda: fn(qkv, c, s, lens, q, kc.half(), vc))
    assert "v_cache" in _errors(lambda: fn(qkv, c, s, lens, q, kc, torch.zeros(B, S + 1, Hk, D)))
    assert "even head size" in _errors(lambda: fn(torch.randn(B, T, (Hq + 2 * Hk) * 7), torch.randn(B, T, 7),
                                                  torch.randn(B, T, 7), lens, torch.empty(B, T, Hq, 7),
                                                  torch.zeros(B, S, Hk, 7), torch.zeros(B, S, Hk, 7)))
    assert "cos" in _errors(lambda: fn(qkv, torch.randn(B, T, 6), s, lens, q, kc, vc))
    assert "prefix_lens" in _errors(lambda: fn(qkv, c, s, lens.int(), q, kc, vc))
    assert "q_out" in _errors(lambda: fn(qkv, c, s, lens, torch.empty(B, T, Hq, D).transpose(1, 2).contiguous()
                                          .transpose(1, 2), kc, vc))
    assert "contiguous" in _errors(lambda: fn(qkv, c, s, lens, q, torch.zeros(B, S, Hk, 2 * D)[..., ::2], vc))
    assert not kc.any() and not vc.any()                      # nothing written by a refused call


def test_the_wrapper_names_the_device_for_a_gpu_tensor():
    assert "CPU" in _errors(lambda: ops.rms_norm(torch.randn(2, 4, device="meta"), torch.randn(4, device="meta"), 1e-5))
    m = dict(device="meta")
    assert "CPU" in _errors(lambda: ops.rope(torch.randn(1, 1, 2, 4, **m), torch.randn(1, 1, 2, 4, **m),
                                             torch.randn(1, 1, 4, **m), torch.randn(1, 1, 4, **m)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_models_run_their_glue_through_the_ops_with_the_formulas_results(dtype, monkeypatch):
    """A target forward with CPU_GLUE_OPS gives the formulas' logits (RoPE bit for bit; RMSNorm's
    double sum may move the last bit), calls the ops, and autograd falls back to the formulas."""
    import heterospec.models.layers as layers
    from heterospec import TargetModel
    from models_util import tiny_llama

    model = TargetModel.from_hf(tiny_llama(seed=6, dtype=dtype))
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    pos = torch.arange(5).expand(2, 5)

    def run():
        cache = model.new_cache(2, 16)
        with torch.inference_mode():
            return model(ids, pos, cache, torch.zeros(2, dtype=torch.long))[0]

    monkeypatch.setattr(layers, "CPU_GLUE_OPS", False)
    formulas = run()
    monkeypatch.setattr(layers, "CPU_GLUE_OPS", True)
    with torch.profiler.profile() as prof:
        with_ops = run()
    names = {e.name for e in prof.events()}
    assert "heterospec::rms_norm" in names and "heterospec::rope" in names
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(with_ops, formulas, **tol)
    # tables that broadcast over the batch take the formula (the op wants them per token)
    from heterospec.models.layers import apply_rope, rope_qk
    q, k = torch.randn(2, 3, 4, 8).to(dtype), torch.randn(2, 3, 2, 8).to(dtype)
    cos, sin = torch.randn(1, 3, 8).to(dtype), torch.randn(1, 3, 8).to(dtype)
    got = rope_qk(q, k, cos, sin)
    assert torch.equal(got[0], apply_rope(q, cos, sin)) and torch.equal(got[1], apply_rope(k, cos, sin))
    # autograd needs the formulas: a forward with gradients never calls the ops
    x = torch.randn(2, 3, model.config.hidden_size, dtype=dtype, requires_grad=True)
    norm = model.layers[0].input_layernorm
    with torch.profiler.profile() as prof:
        y = norm(x)
    assert "heterospec::rms_norm" not in {e.name for e in prof.events()}
    y.float().sum().backward()
    assert x.grad is not None
