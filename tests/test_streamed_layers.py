"""The target's streamed layers (models/target.py, StreamedLayer): a CPU forward whose every
linear runs its stream path calls the kernels without the modules. It must give the modules'
bits exactly, and fall back to the modules whenever a path decision or a weight changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from heterospec.models import linear as L
from heterospec.models import target as TM

pytestmark = pytest.mark.skipif(not (L.packed_linear_available() and L.stream_linear_available(torch.float32)),
                                reason="needs the CPU stream_linear op and oneDNN")


@pytest.fixture
def streamed_engine(tmp_path, monkeypatch):
    """An engine on a tiny Llama (widths multiples of 32: the stacked groups fuse) whose linears
    all take the stream path (timed so), at every row count."""
    from heterospec import Engine
    from tests.engine_util import every_linear_streams, tiny_hf_llama
    every_linear_streams(monkeypatch, tmp_path)
    hf = tiny_hf_llama(vocab=96, hidden=64, heads=2, kv_heads=1, dtype=torch.float32)
    return Engine(hf)


def _inputs(B, T, L0=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (B, T), generator=g)
    prefix = torch.tensor([L0 + 3 * b for b in range(B)])
    mask = (torch.rand(B, T, T, generator=g) < 0.5).tril() | torch.eye(T, dtype=torch.bool)
    mask[:, :, 0] = True
    return ids, prefix[:, None] + torch.arange(T), prefix, mask


def _forward(tgt, B, T, streamed: bool, seed=0, num_nodes=None):
    """Prefill then one tree forward of T rows (``num_nodes``: ragged, the real rows per request);
    returns (logits, features, the tree's K)."""
    ids, pos, prefix, mask = _inputs(B, T, seed=seed)
    cache = tgt.new_cache(B, 64)
    g = torch.Generator().manual_seed(seed + 1)
    ctx = torch.randint(3, 96, (B, int(prefix.max())), generator=g)
    old = TM.STREAMED_LAYERS
    TM.STREAMED_LAYERS = streamed
    try:
        with torch.inference_mode():
            tgt(ctx, torch.arange(ctx.shape[1]).expand(B, -1), cache, torch.zeros(B, dtype=torch.long))
            kw = {} if num_nodes is None else dict(num_nodes=torch.tensor(num_nodes), ragged=True)
            logits, feats = tgt(ids, pos, cache, prefix, tree_mask=mask, **kw)
    finally:
        TM.STREAMED_LAYERS = old
    n = [T] * B if num_nodes is None else num_nodes
    keys = torch.cat([cache.k[:, b, int(prefix[b]):int(prefix[b]) + n[b]].flatten() for b in range(B)])
    return logits, feats, keys


@pytest.mark.parametrize("B,T", [(1, 1), (1, 7), (2, 4), (3, 9)])
def test_streamed_layers_give_the_modules_bits(streamed_engine, B, T):
    tgt = streamed_engine.target
    with torch.inference_mode():
        assert tgt._stream_plans(torch.zeros(B, T, 64)) is not None        # the streamed path is taken
    want, got = _forward(tgt, B, T, streamed=False), _forward(tgt, B, T, streamed=True)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_ragged_batches_stream_on_their_real_rows(streamed_engine):
    tgt = streamed_engine.target
    with torch.inference_mode():
        assert tgt._stream_plans(torch.zeros(1, 9, 64)) is not None        # 9 real rows, packed
    want = _forward(tgt, 3, 5, streamed=False, num_nodes=[5, 1, 3])
    got = _forward(tgt, 3, 5, streamed=True, num_nodes=[5, 1, 3])
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_unfused_groups_stream_member_by_member(streamed_engine):
    tgt = streamed_engine.target
    want = _forward(tgt, 2, 5, streamed=False)
    L.tune_linears([tgt], fuse=False)
    with torch.inference_mode():
        plans = tgt._stream_plans(torch.zeros(2, 5, 64))
    assert plans is not None and len(plans[0].qkv) == 3 and len(plans[0].gate_up) == 2
    got = _forward(tgt, 2, 5, streamed=True)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_a_changed_weight_or_decision_is_never_served_from_kept_calls(streamed_engine):
    tgt = streamed_engine.target
    x = torch.zeros(1, 3, 64)
    with torch.inference_mode():
        assert tgt._stream_plans(x) is not None
    q = tgt.layers[1].self_attn.q_proj
    with torch.no_grad():
        q.weight.mul_(1.5)                      # written in place: the packed copies are stale
    with torch.inference_mode():
        assert tgt._stream_plans(x) is None     # the modules run (their own fallbacks apply)
    want, got = _forward(tgt, 1, 3, streamed=False), _forward(tgt, 1, 3, streamed=True)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    ref = torch.nn.functional.linear(torch.ones(1, 64), q.weight)
    with torch.inference_mode():
        assert torch.allclose(q(torch.ones(1, 64)), ref, atol=1e-5)

    L.tune_linears([tgt])                       # packed again: streamed again
    with torch.inference_mode():
        assert tgt._stream_plans(x) is not None
    tgt.layers[0].mlp.down_proj.weight = nn.Parameter(torch.randn(64, 136), requires_grad=False)   # replaced
    with torch.inference_mode():
        assert tgt._stream_plans(x) is None
    L.tune_linears([tgt])
    with torch.inference_mode():
        assert tgt._stream_plans(x) is not None
    tgt.layers[2].self_attn.o_proj.set_stream([False] * len(L.TUNE_ROWS))   # a decision changed
    with torch.inference_mode():
        assert tgt._stream_plans(x) is None
    want, got = _forward(tgt, 1, 3, streamed=False), _forward(tgt, 1, 3, streamed=True)
    assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_streamed_layers_need_autograd_off(streamed_engine):
    tgt = streamed_engine.target
    with torch.no_grad():
        assert tgt._stream_plans(torch.zeros(1, 2, 64)) is not None
    with torch.enable_grad():
        assert tgt._stream_plans(torch.zeros(1, 2, 64)) is None
    old = TM.STREAMED_LAYERS
    TM.STREAMED_LAYERS = False
    try:
        with torch.no_grad():
            assert tgt._stream_plans(torch.zeros(1, 2, 64)) is None
    finally:
        TM.STREAMED_LAYERS = old


def test_greedy_decoding_is_unchanged_by_streamed_layers(streamed_engine):
    eng = streamed_engine
    old = TM.STREAMED_LAYERS
    try:
        TM.STREAMED_LAYERS = False
        want = eng.generate([1, 5, 9, 14], max_new_tokens=16, method="autoregressive").token_ids
        TM.STREAMED_LAYERS = True
        got = eng.generate([1, 5, 9, 14], max_new_tokens=16, method="autoregressive").token_ids
    finally:
        TM.STREAMED_LAYERS = old
    assert got == want


def test_the_cost_model_fingerprint_names_how_the_layers_run(streamed_engine):
    """A cost model measured with the modules running (slower steps) is reported, never reused."""
    from heterospec.costmodel import fingerprint, fingerprint_differences
    on = fingerprint(streamed_engine)
    old = TM.STREAMED_LAYERS
    TM.STREAMED_LAYERS = False
    try:
        off = fingerprint(streamed_engine)
    finally:
        TM.STREAMED_LAYERS = old
    assert on["layers"] == "streamed" and off["layers"] == "modules"
    assert any(d.startswith("layers:") for d in fingerprint_differences(off, on))


def test_an_engine_call_checks_its_weights_once_and_after_each_stream_callback(streamed_engine, monkeypatch):
    """Inside an engine call (``settled_weights``) the kept calls' weights are checked at the first
    forward and again only after user code ran (a stream callback: ``weights_may_change``), not at
    every forward; outside a call, and in another thread, every forward checks. A weight that a
    stream callback writes in place is what the next forward uses."""
    import threading

    from heterospec import engine as engine_mod
    tgt = streamed_engine.target
    checks = []
    unchanged = L._unchanged
    monkeypatch.setattr(L, "_unchanged", lambda watch: checks.append(threading.get_ident()) or unchanged(watch))
    x = torch.zeros(1, 1, 64)
    with torch.inference_mode():
        assert tgt._stream_plans(x) is not None          # built (nothing to check yet)
        checks.clear()
        tgt._stream_plans(x)
        tgt._stream_plans(x)
        assert len(checks) == 2                          # outside a call: every forward
        checks.clear()
        with L.settled_weights():
            for _ in range(3):
                assert tgt._stream_plans(x) is not None
            assert len(checks) == 1
            def elsewhere():
                with torch.inference_mode():             # (autograd's mode is per thread too)
                    tgt._stream_plans(x)
                    tgt._stream_plans(x)

            other = threading.Thread(target=elsewhere)
            other.start()
            other.join()
            assert len(checks) == 3 and checks[1] == checks[2] != checks[0]   # the other thread: each time
            L.weights_may_change()
            tgt._stream_plans(x)
            tgt._stream_plans(x)
            assert len(checks) == 4
            with torch.no_grad():
                tgt.layers[1].mlp.down_proj.weight.mul_(-3.0)
            L.weights_may_change()
            assert tgt._stream_plans(x) is None          # seen: the modules run
        L.tune_linears([tgt])
    # A stream callback that writes a weight in place: the tokens after it are the new weights',
    # as the modules (which check their weights on every call) compute them.
    w = tgt.layers[1].mlp.down_proj.weight
    orig = w.detach().clone()

    def run(streamed: bool, notice=True):
        with torch.no_grad():
            w.copy_(orig)
        L.tune_linears([tgt])
        seen = []

        def stream(toks):
            seen.append(toks)
            if len(seen) == 3:       # (the one-row calls were built and checked in this call by then)
                with torch.no_grad():
                    w.mul_(-3.0)

        old, old_notice = TM.STREAMED_LAYERS, engine_mod.weights_may_change
        TM.STREAMED_LAYERS = streamed
        if not notice:
            engine_mod.weights_may_change = lambda: None
        try:
            return streamed_engine.generate([1, 5, 9, 14], max_new_tokens=12, method="autoregressive",
                                            stream=stream).token_ids
        finally:
            TM.STREAMED_LAYERS, engine_mod.weights_may_change = old, old_notice

    want = run(streamed=False)
    assert run(streamed=True) == want
    assert run(streamed=True, notice=False) != want      # (without the notice the stale codes run)
