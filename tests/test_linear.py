"""CPU linear layers that pick the faster GEMM path per shape and row count (models/linear.py):
the reordered path is checked against F.linear, and every situation where the reordered copy
could be stale or unusable falls back to F.linear."""

import pytest
import torch
from torch import nn

from heterospec.models import linear as L

pytestmark = pytest.mark.skipif(not L.packed_linear_available(), reason="torch built without oneDNN")


def _tuned(in_f=64, out_f=96, bias=True, use=True):
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f, bias=bias)
    ref = nn.Linear(in_f, out_f, bias=bias)
    ref.load_state_dict(lin.state_dict())
    lin.__class__ = L.TunedLinear
    lin.set_packed([use] * len(L.TUNE_ROWS))
    return lin, ref


# The decision rules do not depend on the grid; these tables are written for this one.
EIGHT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


@pytest.fixture
def eight_row_grid(monkeypatch):
    monkeypatch.setattr(L, "TUNE_ROWS", EIGHT_ROWS)


@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (2, 5, 64), (200, 64), (0, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_reordered_path_matches_f_linear(shape, bias):
    lin, ref = _tuned(bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        got, want = lin(x), ref(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_row_buckets_pick_the_decision_of_the_next_timed_row_count(eight_row_grid):
    assert [L._row_bucket(m) for m in (0, 1, 2, 3, 4, 5, 8, 9, 128, 129, 10_000)] == [0, 0, 1, 2, 2, 3, 3, 4, 7, 7, 7]
    t = {"ok": True, "rows": list(L.TUNE_ROWS), "stock_ms": [1.0] * 8, "packed_ms": [0.5, 0.96, 1.2, 0.9, 2, 2, 2, 2]}
    assert L.decisions(t) == [True, False, False, True, False, False, False, False]
    assert L.decisions({"ok": False}) == [False] * len(L.TUNE_ROWS)


def test_a_tree_s_row_counts_have_buckets_of_their_own():
    """Every row count a verified tree or a draft layer has (1-16) is timed itself, not decided
    by a larger count's timing (9 rows ran the path timed fastest at 16)."""
    assert L.TUNE_ROWS == tuple(sorted(set(L.TUNE_ROWS))) and L.TUNE_ROWS[-1] == 128
    for m in range(1, 17):
        r = L.TUNE_ROWS[L._row_bucket(m)]
        assert r >= m and (r == m or r - m <= 3 and m > 4), (m, r)
    assert L._row_bucket(0) == 0 and L._row_bucket(10_000) == len(L.TUNE_ROWS) - 1
    # 9 rows: the decision timed at 10, not at 16
    t = {"ok": True, "rows": list(L.TUNE_ROWS), "stock_ms": [9.0] * len(L.TUNE_ROWS),
         "packed_ms": [5.0] * len(L.TUNE_ROWS), "stream_ms": [3.0 if r <= 12 else 5.5 for r in L.TUNE_ROWS]}
    assert L.stream_decisions(t)[L._row_bucket(9)] and not L.stream_decisions(t)[L._row_bucket(16)]


def test_stale_or_unusable_reordered_weight_falls_back_to_f_linear(monkeypatch):
    lin, ref = _tuned()
    calls = []
    real = L._packed_forward
    monkeypatch.setattr(L, "_packed_forward", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(4, 64)
    with torch.inference_mode():
        lin(x)
    assert calls == [1]
    with torch.no_grad():                       # modified in place: the copy is stale
        lin.weight.mul_(2.0)
        ref.weight.mul_(2.0)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), ref(x))
    assert calls == [1]
    lin.weight = nn.Parameter(torch.randn(96, 64))   # replaced
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert calls == [1]
    lin.set_packed([True] * len(L.TUNE_ROWS))        # re-reordered: used again
    with torch.inference_mode():
        lin(x)
        lin(x.double().float())
    assert calls == [1, 1, 1]
    y = lin(x.requires_grad_())                      # autograd needs a gradient: stock path
    y.sum().backward()
    assert calls == [1, 1, 1] and x.grad is not None and lin.weight.grad is not None
    with torch.inference_mode():                     # another dtype: stock path (its own error)
        with pytest.raises(RuntimeError):
            lin(torch.randn(4, 64, dtype=torch.float64))
    assert calls == [1, 1, 1]


def test_pad_decisions_pad_up_to_a_faster_larger_row_count(eight_row_grid):
    # two rows slower than four (oneDNN's kernels on the AVX-512 EPYC): pad 2 -> 4; one row is
    # not 5 % slower than four: no pad; 8 rows would need 16 (reach 1) or 32 (reach 2)
    t = {"ok": True, "rows": list(L.TUNE_ROWS), "stock_ms": [1.0, 2.0, 2.0, 3.0, 4.0, 5.0, 9.0, 16.0],
         "packed_ms": [0.9, 1.5, 0.88, 2.5, 2.0, 1.0, 8.0, 15.0]}
    assert L.pad_decisions(t) == [0, 4, 0, 32, 32, 0, 0, 0]
    assert L.pad_decisions(t, reach=1) == [0, 4, 0, 16, 32, 0, 0, 0]
    assert L.pad_decisions({"ok": False}) == [0] * len(L.TUNE_ROWS)


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (1, 2, 64), (3, 64), (0, 64)])
def test_padded_rows_give_f_linear_results(shape, eight_row_grid):
    lin, ref = _tuned(bias=True)
    lin.set_packed([True] * len(L.TUNE_ROWS), [4, 4, 8, 0, 0, 0, 0, 0])
    x = torch.randn(*shape)
    with torch.inference_mode():
        got, want = lin(x), ref(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="pad_rows"):
        lin.set_packed([False] * len(L.TUNE_ROWS), [4] + [0] * (len(L.TUNE_ROWS) - 1))
    with pytest.raises(ValueError, match="pad_rows"):
        lin.set_packed([True] * len(L.TUNE_ROWS), [4])


def test_shapes_are_timed_cache_cold():
    """A decode step reads every weight from memory: the copies visited in turn while timing a
    shape add up to COLD_FACTOR x the last-level cache (capped), one copy when it alone is larger."""
    llc = 32 << 20
    for nbytes in (4 << 10, 1 << 20, 3 << 20, 20 << 20, 64 << 20, 200 << 20):
        n = L.cold_copies(nbytes, llc)
        assert 1 <= n <= L.MAX_COPIES
        assert n * nbytes >= L.COLD_FACTOR * llc or n == L.MAX_COPIES
        assert n == 1 or (n - 1) * nbytes < L.COLD_FACTOR * llc      # no more than needed
    assert L.cold_copies(200 << 20, llc) == 1 and L.cold_copies(4 << 10, llc) == L.MAX_COPIES
    assert L.last_level_cache_bytes() > 0
    t = L.time_shape(nn.Linear(64, 96, bias=False), rows=(1, 4), budget_s=0.01, copies=3)
    assert t["ok"] and t["copies"] == 3 and len(t["stock_ms"]) == len(t["packed_ms"]) == 2
    assert all(v > 0 for v in t["stock_ms"] + t["packed_ms"])


class _Quiet:
    """A box with no other work on it (the timings are cached whatever runs beside the test)."""
    def cores(self):
        return 0.0


def test_tuning_converts_plain_linears_in_place_and_keeps_the_state_dict(tmp_path, monkeypatch):
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(L, "_MEMORY", {})
    monkeypatch.setattr(L, "_timing_load", lambda: _Quiet())

    class Sub(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32, bias=False), Sub(32, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 32)
    with torch.inference_mode():
        want = model(x)
    report = L.tune_linears([model, None])
    assert set(report) == {"32x48-float32-bias", "48x32-float32-nobias"}
    assert isinstance(model[0], L.TunedLinear) and isinstance(model[2], L.TunedLinear)
    assert type(model[3]) is Sub                    # subclasses are left alone
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    with torch.inference_mode():
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    saved = list(tmp_path.rglob("linear-*.json"))
    assert len(saved) == 1                          # timings cached for this machine
    monkeypatch.setattr(L, "_MEMORY", {})
    monkeypatch.setattr(L, "time_shape", lambda *a, **k: pytest.fail("timed again despite the cache"))
    assert L.tune_linears([model]).keys() == report.keys()
    without = L.tune_linears([model], stream=False)   # the choice before stream_linear: never it
    assert all(not r["stream_rows"] for r in without.values()) and model[0]._stream is None
    L.untune_linears([model])
    assert model[0]._packed is None


def test_engine_linear_modes_give_the_same_greedy_tokens():
    from heterospec import Engine
    from tests.engine_util import tiny_hf_llama
    hf = tiny_hf_llama(dtype=torch.float32)
    with pytest.raises(ValueError, match="linear must be one of"):
        Engine(hf, linear="fast")
    outs = {}
    for mode in ("stock", "tuned"):
        eng = Engine(hf, linear=mode)
        assert bool(eng.linear_report) == (mode == "tuned")
        outs[mode] = eng.generate([1, 2, 3, 4], max_new_tokens=12, method="autoregressive").token_ids
    assert outs["stock"] == outs["tuned"]


def test_an_emulated_isa_is_timed_as_another_machine(monkeypatch):
    for k in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "HETEROSPEC_CPU_SCALAR"):
        monkeypatch.delenv(k, raising=False)
    native = L._cache_file()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert L._cache_file() != native and L._machine_key()["isa_env"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_stream_path_matches_f_linear_and_falls_back_when_stale(monkeypatch):
    lin, ref = _tuned(use=False)
    lin.set_stream([True] * len(L.TUNE_ROWS))
    calls = []
    real = L._stream_forward
    monkeypatch.setattr(L, "_stream_forward", lambda *a: calls.append(1) or real(*a))
    for shape in [(1, 64), (3, 64), (2, 5, 64), (0, 64)]:
        x = torch.randn(*shape)
        with torch.inference_mode():
            torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-5)
    assert len(calls) == 4
    with torch.no_grad():                       # modified in place: the packed copy is stale
        lin.weight.add_(1.0)
        ref.weight.add_(1.0)
    x = torch.randn(4, 64)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), ref(x))
    assert len(calls) == 4
    lin.set_stream([True] * len(L.TUNE_ROWS))   # packed again: used again
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-5)
    assert len(calls) == 5
    y = lin(x.requires_grad_())                  # autograd: stock path
    y.sum().backward()
    assert len(calls) == 5 and lin.weight.grad is not None


def test_stream_path_wins_over_the_reordered_one_per_bucket(monkeypatch):
    lin, ref = _tuned(use=True)
    use = [r <= 8 for r in L.TUNE_ROWS]
    lin.set_stream(use)
    seen = []
    real_s, real_p = L._stream_forward, L._packed_forward
    monkeypatch.setattr(L, "_stream_forward", lambda *a: seen.append("stream") or real_s(*a))
    monkeypatch.setattr(L, "_packed_forward", lambda *a: seen.append("packed") or real_p(*a))
    with torch.inference_mode():
        for m in (1, 8, 9, 200):
            x = torch.randn(m, 64)
            torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-5)
    assert seen == ["stream", "stream", "packed", "packed"]


def test_stream_packing_serves_float32_and_bfloat16_only():
    lin = nn.Linear(64, 96).to(torch.float16)
    lin.__class__ = L.TunedLinear
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        lin.set_stream([True] * len(L.TUNE_ROWS))
    lin.set_stream([False] * len(L.TUNE_ROWS))   # nothing to pack: fine
    with pytest.raises(ValueError, match="one entry per row bucket"):
        lin.set_stream([False])
    assert not L.stream_linear_available(torch.float16)
    assert L.stream_linear_available(torch.bfloat16) and L.stream_linear_available(torch.float32)


def test_bfloat16_linear_streams_half_the_bytes_with_float32_sums():
    """A bfloat16 TunedLinear on the stream path: the float32 FMA chain of the widened weights,
    rounded once - F.linear's value up to bf16 rounding, and row-invariant."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 96).to(torch.bfloat16)
    ref = nn.Linear(64, 96).to(torch.bfloat16)
    ref.load_state_dict(lin.state_dict())
    lin.__class__ = L.TunedLinear
    lin.set_stream([True] * len(L.TUNE_ROWS))
    assert lin._stream.dtype == torch.bfloat16
    with torch.inference_mode():
        x = torch.randn(9, 64).to(torch.bfloat16)
        y = lin(x)
        exact = (x.double() @ lin.weight.double().T + lin.bias.double()).to(torch.bfloat16)
        assert y.dtype == torch.bfloat16
        assert (y.float() - exact.float()).abs().max() <= 0.02 * exact.float().abs().max()
        torch.testing.assert_close(y, ref(x), rtol=2e-2, atol=2e-2)
        assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(9)]), y)


def test_stream_decisions_pick_stream_where_it_beats_every_other_path(eight_row_grid):
    rows = list(L.TUNE_ROWS)
    t = {"ok": True, "rows": rows, "stock_ms": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
         "packed_ms": [2.0, 1.0, 9.0, 3.0, 9.0, 9.0, 9.0, 9.0],
         "stream_ms": [0.96, 1.1, 2.5, 3.5, 4.0, 9.0, 6.0, 7.9]}
    # bucket 0: not 5 % below stock; 1: the reordered path is faster; 2: stream; 3: reordered;
    # 4: stream; 5: slower; 6: stream; 7: not 5 % below stock
    assert L.stream_decisions(t) == [False, False, True, False, True, False, True, False]
    t2 = dict(t, packed_ms=[2.0, 9.0, 1.0, 9.0, 9.0, 9.0, 9.0, 9.0])   # 2 rows padded to 4 (1.0 ms)
    assert L.stream_decisions(t2)[1] is False
    assert L.stream_decisions({"ok": True, "rows": rows, "stock_ms": [1.0] * 8, "packed_ms": [1.0] * 8}) == [False] * 8
    assert L.stream_decisions({"ok": False}) == [False] * 8


def test_a_stream_timing_above_a_larger_row_count_s_is_read_as_the_larger_one(eight_row_grid):
    """Streaming fewer rows never costs more (the weight is read once either way): a disturbed
    timing at one row count does not hand that bucket to a slower path."""
    assert L.stream_envelope([1.0, 3.0, 2.0, 2.5, 9.0, 4.0]) == [1.0, 2.0, 2.0, 2.5, 4.0, 4.0]
    rows = list(L.TUNE_ROWS)
    t = {"ok": True, "rows": rows, "stock_ms": [20.0] * 8, "packed_ms": [5.0, 5.0, 6.0, 6.0, 8.0, 9.0, 12.0, 14.0],
         "stream_ms": [2.0, 2.5, 3.0, 4.0, 14.0, 6.0, 7.0, 15.0]}
    # bucket 4: 14 ms measured, 6 ms at the next row count: streams (the packed path took 8)
    assert L.stream_decisions(t) == [True] * 7 + [False]
    assert L.chosen_ms(t, L.stream_decisions(t), [False] * 8)[4] == 6.0


def test_float32_and_bfloat16_shapes_time_the_stream_path_and_others_do_not():
    t = L.time_shape(nn.Linear(64, 96, bias=True), rows=(1, 4), budget_s=0.01, copies=2)
    assert t["ok"] and len(t["stream_ms"]) == 2 and all(v > 0 for v in t["stream_ms"])
    t = L.time_shape(nn.Linear(64, 96, bias=False).to(torch.bfloat16), rows=(1,), budget_s=0.01, copies=2)
    assert t["ok"] and len(t["stream_ms"]) == 1 and len(t["stock_ms"]) == 1   # with or without oneDNN's bf16
    t = L.time_shape(nn.Linear(64, 96, bias=False).to(torch.float16), rows=(1,), budget_s=0.01, copies=2)
    assert "stream_ms" not in t


@pytest.mark.parametrize("failure", ["raises", "wrong"])
def test_a_reordered_path_that_cannot_run_here_leaves_the_stock_and_stream_paths_timed(monkeypatch, failure):
    """oneDNN's bfloat16 reorder raises on an AVX2-only CPU (it needs AVX-512BW or AVX-NE-CONVERT):
    the shape is still timed, its reordered path never chosen (infinite times), its stream path
    chosen where faster, as on any CPU (before, the whole shape was 'not ok' there and a bfloat16
    model never streamed)."""
    def reorder(w):
        if failure == "raises":
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw\nmore")
        return L.torch.zeros_like(w)             # a reorder whose forward is wrong
    monkeypatch.setattr(L, "_reorder", reorder)
    if failure == "wrong":
        monkeypatch.setattr(L, "_packed_forward", lambda x, p, b: L.F.linear(x, p, b))
    t = L.time_shape(nn.Linear(64, 96, bias=False), rows=L.TUNE_ROWS, budget_s=0.01, copies=1)
    assert t["ok"] and len(t["stock_ms"]) == len(t["stream_ms"]) == len(L.TUNE_ROWS)
    assert t["packed_ms"] == [float("inf")] * len(L.TUNE_ROWS)
    assert t["packed_error"] == ("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw"
                                 if failure == "raises" else "reordered result differs from F.linear")
    assert L.decisions(t) == [False] * len(L.TUNE_ROWS) and L.pad_decisions(t) == [0] * len(L.TUNE_ROWS)
    fast = {**t, "stream_ms": [min(v) * 1e-3 for v in zip(t["stock_ms"])]}
    assert L.stream_decisions(fast) == [True] * len(L.TUNE_ROWS)


def test_timings_of_the_old_format_are_not_reused():
    """The saved timings' file is keyed by their format: files written before a reorder failure
    stopped hiding a shape's stream times are timed again."""
    assert L._machine_key()["timings"] == 2


def _siblings(outs=(64, 32, 32), in_f=48, bias=False, seed=0):
    torch.manual_seed(seed)
    mods = [nn.Linear(in_f, o, bias=bias) for o in outs]
    for m in mods:
        m.__class__ = L.TunedLinear
        m.set_stream([True] * len(L.TUNE_ROWS))
    return mods


@pytest.mark.parametrize("bias", [False, True])
def test_fused_siblings_give_the_members_stream_bits(bias):
    """One stacked stream_linear call = each member's own stream call, bit for bit (each output is
    the same FMA chain), at every row count; outputs are views of the right shapes."""
    mods = _siblings(bias=bias)
    fused = L.FusedStream(mods, [True] * len(L.TUNE_ROWS))
    for shape in [(1, 48), (3, 48), (2, 7, 48), (13, 48), (0, 48)]:
        x = torch.randn(*shape)
        with torch.inference_mode():
            got = fused(x)
            want = [m(x) for m in mods]
        assert got is not None and len(got) == 3
        for g, w, m in zip(got, want, mods):
            assert g.shape == (*shape[:-1], m.out_features) and torch.equal(g, w)
            torch.testing.assert_close(g, torch.nn.functional.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)


def test_fused_siblings_step_aside_where_they_cannot_serve():
    mods = _siblings()
    fused = L.FusedStream(mods, [r <= 4 for r in L.TUNE_ROWS])
    with torch.inference_mode():
        assert fused(torch.randn(4, 48)) is not None
        assert fused(torch.randn(5, 48)) is None                   # a bucket not fused
        assert fused(torch.randn(2, 48, dtype=torch.float64)) is None
    with torch.no_grad():
        mods[1].weight.add_(1.0)                                    # stale stacked copy
    with torch.inference_mode():
        assert fused(torch.randn(2, 48)) is None
    fresh = L.FusedStream(mods, [True] * len(L.TUNE_ROWS))
    assert fresh(torch.randn(2, 48, requires_grad=True)) is None    # autograd needs the weights
    for bad, msg in (((64, 31), "multiples"), ((64,), "multiples")):
        with pytest.raises(ValueError, match=msg):
            L.FusedStream(_siblings(outs=bad), [True] * len(L.TUNE_ROWS))
    with pytest.raises(ValueError, match="in_features"):
        L.FusedStream(_siblings()[:1] + _siblings(in_f=32)[:1], [True] * len(L.TUNE_ROWS))
    with pytest.raises(ValueError, match="row bucket"):
        L.FusedStream(_siblings(), [True])
    bf = _siblings()
    for m in bf:
        m.to(torch.float16)
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        L.FusedStream(bf, [True] * len(L.TUNE_ROWS))


def test_tuning_fuses_siblings_where_measured_faster(tmp_path, monkeypatch):
    """A target whose Q, K, V have multiples of 32 outputs gets a FusedStream where the stacked
    call was timed faster (here: made so), greedy decoding is unchanged, and fuse=False or
    untuning drops it."""
    from heterospec import Engine
    from heterospec.models.layers import QKVO
    from tests.engine_util import tiny_hf_llama
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(L, "_MEMORY", {})
    real = L.time_shape

    def timed(layer, *a, **k):
        t = real(layer, rows=L.TUNE_ROWS, budget_s=0.01, copies=1)
        if layer.out_features == 128:                 # the stacked Q, K, V (64 + 32 + 32)
            t["stream_ms"] = [1e-6] * len(t["rows"])
        return t
    monkeypatch.setattr(L, "time_shape", timed)
    hf = tiny_hf_llama(hidden=64, heads=2, kv_heads=1, dtype=torch.float32)
    stock = Engine(hf, linear="stock")
    ref = stock.generate([1, 2, 3, 4], max_new_tokens=12, method="autoregressive").token_ids
    eng = Engine(hf)
    attn = [m for m in eng.target.modules() if isinstance(m, QKVO)]
    assert attn and all(isinstance(a._fused, L.FusedStream) and all(a._fused.use) for a in attn)
    assert any(k.startswith("fused:") for k in eng.linear_report)
    assert eng.generate([1, 2, 3, 4], max_new_tokens=12, method="autoregressive").token_ids == ref
    L.tune_linears([eng.target], fuse=False)
    assert all(a._fused is None for a in attn)
    L.tune_linears([eng.target])
    assert all(a._fused is not None for a in attn)
    L.untune_linears([eng.target])
    assert all(a._fused is None for a in attn)


def test_a_fused_group_is_timed_in_its_members_dtype(tmp_path, monkeypatch):
    """The stacked shape of bfloat16 siblings is timed in bfloat16 (its decision is bf16's)."""
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(L, "_MEMORY", {})
    real, seen = L.time_shape, {}

    def timed(layer, *a, **k):
        seen[layer.out_features] = layer.weight.dtype
        return real(layer, rows=L.TUNE_ROWS, budget_s=0.01, copies=1)
    monkeypatch.setattr(L, "time_shape", timed)
    from heterospec.models.layers import QKVO
    attn = QKVO(64, 64, 2, 1, 32).to(torch.bfloat16)
    L.tune_linears([attn])
    assert seen[128] == torch.bfloat16                 # the stacked Q, K, V (64 + 32 + 32)


def test_timings_taken_beside_other_work_are_not_cached(tmp_path, monkeypatch):
    import json
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(L, "_MEMORY", {})

    class Busy:
        def cores(self):
            return 1.7
    monkeypatch.setattr(L, "_timing_load", lambda: Busy())
    model = nn.Sequential(nn.Linear(32, 48))
    with pytest.warns(UserWarning, match="1.7 CPU cores busy"):
        report = L.tune_linears([model])
    assert "32x48-float32-bias" in report and isinstance(model[0], L.TunedLinear)
    (saved,) = tmp_path.rglob("linear-*.json")
    assert json.loads(saved.read_text())["shapes"] == {}          # the next process times again


def _gguf_like(model: nn.Module) -> None:
    """Replace every linear weight of ``model`` by its GGUF Q4_1 values (as a converted file holds)."""
    from reference import quantize_q4_1_ref
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.Linear) and mod.in_features % 32 == 0:
                mod.weight.copy_(quantize_q4_1_ref(mod.weight * 0.5)[0])


def test_block_coded_weights_stream_as_codes_with_the_same_bits(tmp_path, monkeypatch):
    """A float32 weight holding Q4_1 values is timed and streamed as its codes (its own timing
    key), and gives exactly what streaming the float32 weight gives; BLOCK_CODES=False or a
    weight changed in place goes back to the float path."""
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(L, "_MEMORY", {})
    seen = {}
    real = L.time_shape

    def timed(layer, *a, fmt=None, **k):
        seen[layer.out_features] = fmt
        t = real(layer, rows=L.TUNE_ROWS, budget_s=0.01, copies=1, fmt=fmt)
        t["stream_ms"] = [1e-6] * len(t["rows"])        # stream wins everywhere (made so)
        return t
    monkeypatch.setattr(L, "time_shape", timed)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 40))
    _gguf_like(model)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = [torch.ops.heterospec.stream_linear(x, L._stream_pack(model[0].weight), None, 96)]
        want.append(torch.ops.heterospec.stream_linear(want[0], L._stream_pack(model[1].weight), model[1].bias, 40))
    report = L.tune_linears([model], fuse=False)
    assert set(report) == {"64x96-float32-nobias-q4_1", "96x40-float32-bias-q4_1"}
    assert seen == {96: "q4_1", 40: "q4_1"}
    assert all(isinstance(m._stream, tuple) for m in model) and L.coded_formats([model]) == ["q4_1"]
    with torch.inference_mode():
        assert torch.equal(model(x), want[1])
    monkeypatch.setattr(L, "BLOCK_CODES", False)
    monkeypatch.setattr(L, "_MEMORY", {})
    assert set(L.tune_linears([model], fuse=False)) == {"64x96-float32-nobias", "96x40-float32-bias"}
    assert not isinstance(model[0]._stream, tuple) and L.coded_formats([model]) == []
    with torch.inference_mode():
        assert torch.equal(model(x), want[1])
    monkeypatch.setattr(L, "BLOCK_CODES", True)
    L.tune_linears([model], fuse=False)
    with torch.no_grad():
        model[0].weight.add_(1.0)                       # stale codes are never used
    with torch.inference_mode():
        torch.testing.assert_close(model(x), model[1](x @ model[0].weight.T), rtol=1e-5, atol=1e-5)


def test_bfloat16_weights_cast_from_block_coded_float32_stream_as_codes(tmp_path, monkeypatch):
    """A model loaded in bfloat16 from a float32 checkpoint of Q4_1 values keeps the codes of the
    float32 weights (models.layers.assign_weights): its linears are timed and streamed as them
    (their own timing key), with the bits of streaming the bfloat16 weights; a bfloat16 weight
    cast without its source, or changed in place since, streams as bfloat16."""
    from heterospec.models.layers import assign_weights
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(L, "_MEMORY", {})
    real = L.time_shape

    def timed(layer, *a, fmt=None, **k):
        t = real(layer, rows=L.TUNE_ROWS, budget_s=0.01, copies=1, fmt=fmt)
        t["stream_ms"] = [1e-6] * len(t["rows"])        # stream wins everywhere (made so)
        return t
    monkeypatch.setattr(L, "time_shape", timed)
    torch.manual_seed(0)

    def build():
        return nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 40))
    source = build()
    _gguf_like(source)
    coded = build()
    assign_weights(coded, source.state_dict(), torch.bfloat16, "cpu", requires_grad=False, what="test")
    plain = build().to(torch.bfloat16)
    plain.load_state_dict(coded.state_dict())            # the same bfloat16 values, no source
    assert [L.block_codes(m)[0] for m in coded] == ["q4_1", "q4_1"]
    assert [L.block_codes(m) for m in plain] == [None, None]
    report = L.tune_linears([coded, plain], fuse=False)
    assert {"64x96-bfloat16-nobias-q4_1", "96x40-bfloat16-bias-q4_1", "64x96-bfloat16-nobias"} <= set(report)
    assert all(isinstance(m._stream, tuple) for m in coded) and not isinstance(plain[0]._stream, tuple)
    x = torch.randn(5, 64).bfloat16()
    with torch.inference_mode():
        want = plain(x)
        assert torch.equal(coded(x), want)
        assert torch.equal(coded(x[:1]), want[:1])          # row-invariant
    with torch.no_grad():
        coded[0].weight.add_(1.0)                         # stale codes are never used
    assert L.block_codes(coded[0]) is None
    L.tune_linears([coded], fuse=False)
    assert not isinstance(coded[0]._stream, tuple)
    with torch.inference_mode():
        torch.testing.assert_close(coded(x).float(), coded[1](x @ coded[0].weight.T).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("codes_faster", [True, False])
def test_bfloat16_codes_are_used_only_where_measured_faster_than_the_16_bit_stream(tmp_path, monkeypatch,
                                                                                    codes_faster):
    """Per shape, a bfloat16 layer's codes are timed against its 16-bit stream (BF16_CODES_ROWS,
    kept with the machine's timings); where they lose, the layer streams 16-bit weights and
    block_codes says so (no codes: its shape key, fused groups and the cost model's fingerprint
    agree)."""
    from heterospec.models.layers import assign_weights
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(L, "_MEMORY", {})
    real = L.time_shape
    calls = []

    def timed(layer, *a, fmt=None, rows=L.TUNE_ROWS, **k):
        calls.append((tuple(rows), fmt))
        t = real(layer, rows=rows, budget_s=0.01, copies=1, fmt=fmt)
        fast = (fmt is not None) == codes_faster
        t["stream_ms"] = [1e-6 if fast else 1e-5] * len(t["rows"])    # made so
        return t
    monkeypatch.setattr(L, "time_shape", timed)
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(64, 96, bias=False))
    _gguf_like(source)
    model = nn.Sequential(nn.Linear(64, 96, bias=False))
    assign_weights(model, source.state_dict(), torch.bfloat16, "cpu", requires_grad=False, what="test")
    report = L.tune_linears([model], fuse=False)
    assert (tuple(L.BF16_CODES_ROWS), "q4_1") in calls and (tuple(L.BF16_CODES_ROWS), None) in calls
    verdict = L._MEMORY[L._cache_file()]["bf16-codes:64x96-bfloat16-nobias-q4_1"]
    assert len(verdict["codes_ms"]) == len(verdict["stream16_ms"]) == len(L.BF16_CODES_ROWS)
    if codes_faster:
        assert L.block_codes(model[0])[0] == "q4_1" and isinstance(model[0]._stream, tuple)
        assert set(report) == {"64x96-bfloat16-nobias-q4_1"}
    else:
        assert L.block_codes(model[0]) is None and not isinstance(model[0]._stream, tuple)
        assert set(report) == {"64x96-bfloat16-nobias"} and L.coded_formats([model]) == []
    calls.clear()
    L.tune_linears([model], fuse=False)                 # the verdict is kept: not timed again
    assert not any(rows == tuple(L.BF16_CODES_ROWS) for rows, _ in calls)
    x = torch.randn(3, 64).bfloat16()
    with torch.inference_mode():
        assert torch.equal(model(x), torch.ops.heterospec.stream_linear(x, L._stream_pack(model[0].weight), None, 96))


def test_fused_siblings_stack_their_codes(tmp_path, monkeypatch):
    """Q, K, V holding Q4_1 values fuse into one call over their stacked codes: the members'
    float stream bits, greedy decoding unchanged against the stock engine."""
    from heterospec import Engine
    from heterospec.costmodel import fingerprint
    from heterospec.models.layers import QKVO
    from tests.engine_util import tiny_hf_llama
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(L, "_MEMORY", {})
    real = L.time_shape

    def timed(layer, *a, fmt=None, **k):
        t = real(layer, rows=L.TUNE_ROWS, budget_s=0.01, copies=1, fmt=fmt)
        if layer.out_features == 128:                 # the stacked Q, K, V (64 + 32 + 32)
            t["stream_ms"] = [1e-6] * len(t["rows"])
        return t
    monkeypatch.setattr(L, "time_shape", timed)
    hf = tiny_hf_llama(hidden=64, heads=2, kv_heads=1, dtype=torch.float32)
    _gguf_like(hf)
    ref = Engine(hf, linear="stock").generate([1, 2, 3, 4], max_new_tokens=12, method="autoregressive").token_ids
    eng = Engine(hf)
    attn = [m for m in eng.target.modules() if isinstance(m, QKVO)]
    assert attn and all(isinstance(a._fused, L.FusedStream) and isinstance(a._fused.packed, tuple) for a in attn)
    assert any(k.startswith("fused:") and k.endswith("-q4_1") for k in eng.linear_report)
    assert eng.generate([1, 2, 3, 4], max_new_tokens=12, method="autoregressive").token_ids == ref
    x = torch.randn(3, 64)
    a = attn[0]
    with torch.inference_mode():
        fused = a._fused(x)
        each = [torch.ops.heterospec.stream_linear(x, L._stream_pack(m.weight), None, m.out_features)
                for m in a._fused.members]
    assert all(torch.equal(f, e) for f, e in zip(fused, each))
    assert "q4_1" in fingerprint(eng)["linear_codes"]       # a cost model of float weights is not reused


def test_float16_valued_weights_stream_as_float16_with_the_same_bits(tmp_path, monkeypatch):
    """A float32 weight holding float16 values (the shipped draft, stored in float16) packs as
    float16 under its own timing key and gives the float32 weight's stream bits."""
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(L, "_MEMORY", {})
    real = L.time_shape

    def timed(layer, *a, fmt=None, **k):
        t = real(layer, rows=L.TUNE_ROWS, budget_s=0.01, copies=1, fmt=fmt)
        t["stream_ms"] = [1e-6] * len(t["rows"])
        return t
    monkeypatch.setattr(L, "time_shape", timed)
    torch.manual_seed(0)
    lin = nn.Linear(64, 40, bias=True)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.half().float())
    x = torch.randn(3, 64)
    want = torch.ops.heterospec.stream_linear(x, L._stream_pack(lin.weight), lin.bias, 40)
    assert set(L.tune_linears([lin])) == {"64x40-float32-bias-f16"}
    assert lin._stream.dtype == torch.float16 and L.coded_formats([lin]) == ["f16"]
    with torch.inference_mode():
        assert torch.equal(lin(x), want)
