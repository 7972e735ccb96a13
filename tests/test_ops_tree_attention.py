"""tree_attention (CPU) vs its reference: values in every float dtype and on every SIMD path, the
row invariance it promises (a tree node gets a one-token step's bits), and clear errors."""

import os
import subprocess
import sys

import pytest
import torch

import heterospec.ops as ops
from reference import tree_attention_ref
from test_ops_linear import _errors

raw = torch.ops.heterospec


def _case(B, T, Hq, Hkv, D, S, lens, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    mask = (torch.rand(B, T, T, generator=g) < 0.5).tril() | torch.eye(T, dtype=torch.bool)
    return q, k, v, torch.tensor(lens), mask


SHAPES = [  # B, T, Hq, Hkv, D, S, prefix_lens
    (1, 1, 9, 3, 64, 400, [300]),       # a decode step of the built-in target
    (1, 8, 9, 3, 64, 400, [37]),        # a tree verify
    (1, 16, 9, 3, 64, 400, [350]),      # a wide verify after a long prefix: rows cut into chunks
    (3, 5, 9, 3, 64, 90, [57, 0, 16]),  # requests of different lengths, one with no prefix
    (2, 4, 8, 8, 128, 40, [20, 33]),    # no GQA, D = 128
    (2, 3, 4, 2, 32, 30, [5, 17]),      # D = 32 (not an AVX-512 shape)
    (1, 2, 2, 1, 6, 12, [7]),           # D = 6 (the portable loop)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_tree_attention_matches_reference(shape, dtype):
    q, k, v, lens, mask = _case(*shape, dtype=dtype)
    got = ops.tree_attention(q, k, v, lens, mask, shape[4] ** -0.5)
    assert got.shape == q.shape and got.dtype == dtype and got.is_contiguous()
    ref = tree_attention_ref(q, k, v, lens, mask, shape[4] ** -0.5)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_16_bit_cache_is_read_as_its_float32_widening(shape, dtype):
    """float16 / bfloat16 K/V are widened as the kernel reads them: the result is, bit for bit,
    the float32 call on the widened tensors, rounded once to q's dtype. Also for a cache stored
    head-major (slot rows strided)."""
    q, k, v, lens, mask = _case(*shape, dtype=dtype)
    got = ops.tree_attention(q, k, v, lens, mask, shape[4] ** -0.5)
    want = ops.tree_attention(q.float(), k.float(), v.float(), lens, mask, shape[4] ** -0.5).to(dtype)
    assert torch.equal(got, want)
    head_major = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v)]   # [B, S, H, D], S not outer
    assert torch.equal(ops.tree_attention(q, *head_major, lens, mask, shape[4] ** -0.5), want)


def test_tree_attention_is_sdpa_with_the_dense_mask():
    from heterospec.models.layers import sdpa

    q, k, v, lens, mask = _case(2, 6, 9, 3, 64, 80, [40, 11])
    W = int(lens.max()) + 6
    want = sdpa(q, k[:, :W], v[:, :W], ops.dense_tree_attention_mask(mask, lens, W), 0.125)
    torch.testing.assert_close(ops.tree_attention(q, k, v, lens, mask, 0.125), want, rtol=2e-5, atol=2e-6)


def test_strided_query_and_cache_layer():
    q, k, v, lens, mask = _case(2, 3, 6, 3, 64, 50, [10, 30])
    qs = q.transpose(1, 2).contiguous().transpose(1, 2)          # [B, T, H, D] with head-major strides
    cache_k = torch.stack([torch.zeros_like(k), k])              # a layer of [layers, B, S, H, D]
    cache_v = torch.stack([torch.zeros_like(v), v])
    assert torch.equal(ops.tree_attention(qs, cache_k[1], cache_v[1], lens, mask, 0.125),
                       ops.tree_attention(q, k, v, lens, mask, 0.125))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("size", ["small", "chunked"])
def test_a_tree_node_gets_the_bits_of_a_one_token_step(threads, size):
    """Node t of a tree, verified with the others, equals a one-row call over a cache holding its
    context compacted (prefix, then its ancestors and itself in order): what a one-token decode
    step sees after the same tokens. Also unchanged by other requests in the batch. "chunked": a
    call large enough that the kernel cuts each KV head's 48 query rows into chunks for its
    threads (boundaries inside a node's heads), the one-row calls not."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if size == "small":
            Hq, Hkv, D, S, L = 9, 3, 64, 120, 45
            parents = [-1, 0, 0, 1, 1, 2, 4]
        else:
            Hq, Hkv, D, S, L = 9, 3, 64, 340, 300
            parents = [-1] + [(i - 1) // 3 for i in range(1, 16)]
        T = len(parents)
        g = torch.Generator().manual_seed(3)
        q = torch.randn(1, T, Hq, D, generator=g)
        k, v = torch.randn(1, S, Hkv, D, generator=g), torch.randn(1, S, Hkv, D, generator=g)
        mask = torch.zeros(1, T, T, dtype=torch.bool)
        for t in range(T):
            a = t
            while a >= 0:
                mask[0, t, a] = True
                a = parents[a]
        tree = ops.tree_attention(q, k, v, torch.tensor([L]), mask, 0.125)
        other = torch.randn(1, T, Hq, D, generator=g)
        batched = ops.tree_attention(torch.cat([other, q]), torch.cat([torch.randn_like(k), k]),
                                     torch.cat([torch.randn_like(v), v]), torch.tensor([80, L]),
                                     torch.cat([torch.ones_like(mask).tril(), mask]), 0.125)
        assert torch.equal(batched[1], tree[0])
        for t in range(T):
            path = [j for j in range(T) if mask[0, t, j]]
            n = L + len(path) - 1                        # the step's own token sits at slot n
            kc, vc = torch.zeros(1, S, Hkv, D), torch.zeros(1, S, Hkv, D)
            kc[0, :L], vc[0, :L] = k[0, :L], v[0, :L]
            kc[0, L:n + 1], vc[0, L:n + 1] = k[0, [L + j for j in path]], v[0, [L + j for j in path]]
            step = ops.tree_attention(q[:, t:t + 1], kc, vc, torch.tensor([n]), torch.ones(1, 1, 1, dtype=torch.bool),
                                      0.125)
            assert torch.equal(step[0, 0], tree[0, t]), f"node {t}"
    finally:
        torch.set_num_threads(old)


def test_a_draft_step_sees_more_tree_columns_than_it_has_rows():
    """tree_mask [B, T, C] with C > T: a draft step's T new nodes are the last of C tree columns.
    Against the reference, and bit for bit the last T rows of the square call over all C nodes
    (a row depends only on the keys it sees)."""
    B, C, T, Hq, Hkv, D, S = 2, 7, 3, 9, 3, 64, 60
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, C, Hq, D, generator=g)
    k, v = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    lens = torch.tensor([40, 0])
    full = (torch.rand(B, C, C, generator=g) < 0.5).tril() | torch.eye(C, dtype=torch.bool)
    rows = full[:, C - T:].contiguous()
    got = ops.tree_attention(q[:, C - T:], k, v, lens, rows, 0.125)
    torch.testing.assert_close(got, tree_attention_ref(q[:, C - T:], k, v, lens, rows, 0.125), rtol=2e-5, atol=2e-6)
    assert torch.equal(got, ops.tree_attention(q, k, v, lens, full, 0.125)[:, C - T:])
    assert "prefix_lens" in _errors(lambda: ops.tree_attention(q[:, :T], k, v, torch.tensor([S - C + 1, 0]), rows,
                                                                0.125))


_PATH_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
import heterospec.ops as ops
from reference import tree_attention_ref
from test_ops_tree_attention import _case, SHAPES
for shape in SHAPES:
    q, k, v, lens, mask = _case(*shape)
    torch.testing.assert_close(ops.tree_attention(q, k, v, lens, mask, 0.3), tree_attention_ref(q, k, v, lens, mask, 0.3),
                               rtol=2e-5, atol=2e-6)
    for dtype in (torch.bfloat16, torch.float16):   # 16-bit K/V widened in the kernel: the float32 call's bits
        h = [t.to(dtype) for t in (q, k, v)]
        assert torch.equal(ops.tree_attention(*h, lens, mask, 0.3),
                           ops.tree_attention(*[t.float() for t in h], lens, mask, 0.3).to(dtype)), (shape, dtype)
print("ok")
"""


@pytest.mark.parametrize("env", [{"HETEROSPEC_CPU_SCALAR": "1"},
                                 {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}],
                         ids=["portable", "avx2"])
def test_every_simd_path_matches_reference(env):
    """The instruction set is read once per process: each capped path runs in its own."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _PATH_SCRIPT.format(tests=here)], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("call", ["wrapper", "raw"])
def test_bad_input_gets_a_clear_error(call):
    f = ops.tree_attention if call == "wrapper" else raw.tree_attention
    q, k, v, lens, mask = _case(2, 3, 6, 3, 16, 20, [4, 9])
    ok = (q, k, v, lens, mask, 0.25)

    def bad(i, x):
        args = list(ok)
        args[i] = x
        return _errors(lambda: f(*args))

    assert "q" in bad(0, q.double()) and "float" in bad(0, q.double())
    assert "[B, T, Hq, D]" in bad(0, q[0])
    assert "k_cache" in bad(1, k.half())
    assert "v_cache" in bad(2, v[:, :10])
    kv4 = torch.randn(2, 20, 4, 16)
    assert "multiple of the KV heads" in _errors(lambda: f(q, kv4, kv4, lens, mask, 0.25))
    assert "prefix_lens" in bad(3, lens.int())
    assert "prefix_lens" in bad(3, torch.tensor([4, 18]))             # 18 + T > S
    assert "prefix_lens" in bad(3, torch.tensor([-1, 2]))
    assert "tree_mask" in bad(4, mask.int())
    assert "tree_mask" in bad(4, mask[:, :2, :2])
    assert "finite scale" in bad(5, float("nan"))
    lonely = mask.clone()
    lonely[0, 1] = False
    assert "sees no key" in _errors(lambda: f(q, k, v, torch.tensor([0, 9]), lonely, 0.25))
    if call == "wrapper":
        assert "on the CPU" in _errors(lambda: f(q.to("meta"), k, v, lens, mask, 0.25))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_target_attends_with_the_op_and_keeps_sdpa_results(dtype, monkeypatch):
    """A CPU target forward of a few tokens (decode, tree verify) calls tree_attention and gives
    SDPA's logits up to rounding; a long prefill and autograd keep SDPA."""
    import heterospec.models.attention as attention
    from heterospec import TargetModel
    from models_util import tiny_llama

    model = TargetModel.from_hf(tiny_llama(seed=7, dtype=dtype))
    V = model.config.vocab_size
    prompt = torch.randint(0, V, (2, 9))
    tree = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool).expand(2, 4, 4)
    ids = torch.randint(0, V, (2, 4))
    pos = torch.tensor([[9, 10, 10, 11]]).expand(2, 4)
    lens = torch.full((2,), 9, dtype=torch.long)

    def run():
        cache = model.new_cache(2, 32)
        with torch.inference_mode():
            model(prompt, torch.arange(9).expand(2, 9), cache, torch.zeros(2, dtype=torch.long))
            with torch.profiler.profile() as prof:
                out = model(ids, pos, cache, lens, tree_mask=tree.contiguous())[0]
        return out, {e.name for e in prof.events()}

    monkeypatch.setattr(attention, "_TREE_OP_SIMD", True)      # (its portable loop is slow, not wrong)
    monkeypatch.setattr(attention, "CPU_TREE_ATTENTION", False)
    want, names = run()
    assert "heterospec::tree_attention" not in names
    monkeypatch.setattr(attention, "CPU_TREE_ATTENTION", True)
    got, names = run()
    assert "heterospec::tree_attention" in names
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(got, want, **tol)
    cache = model.new_cache(2, 128)
    backend = model.backend
    long = torch.ones(2, attention.TREE_ATTENTION_MAX_T + 1, attention.TREE_ATTENTION_MAX_T + 1, dtype=torch.bool).tril()
    with torch.inference_mode():
        assert isinstance(backend.plan(long, lens, cache, 4, 0.1), attention.SdpaPlan)
        assert isinstance(backend.plan(tree.contiguous(), lens, cache, 4, 0.1), attention.TreeOpPlan)
    with torch.enable_grad():
        assert isinstance(backend.plan(tree.contiguous(), lens, cache, 4, 0.1), attention.SdpaPlan)
    monkeypatch.setattr(attention, "_TREE_OP_SIMD", False)     # no SIMD kernel for it here: the flash kernel
    with torch.inference_mode():
        assert isinstance(backend.plan(tree.contiguous(), lens, cache, 4, 0.1), attention.SdpaPlan)
