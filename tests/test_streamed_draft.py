"""The draft's streamed steps (models/draft.py, StreamedDraft): on the CPU a draft forward of a few
rows whose every linear streams runs without its modules and attends with the tree_attention op
over the draft cache, the round's tree nodes written past the committed prefix
(DraftTreeState.cached). It must give the module path's hidden states and logits (up to
attention's rounding), carry a round that runs out of free slots over to the compact layout, stay
off where a hole or autograd rules it out, and keep greedy decoding lossless."""

from __future__ import annotations

import pytest
import torch

from heterospec.models import attention as A
from heterospec.models import draft as DM
from heterospec.models import linear as L

pytestmark = pytest.mark.skipif(
    not (L.packed_linear_available() and L.stream_linear_available(torch.float32) and A._TREE_OP_SIMD),
    reason="needs the CPU stream_linear op, oneDNN and tree_attention's SIMD kernel")

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture
def pair(tmp_path, monkeypatch):
    """A tiny target and a draft for it (widths multiples of 32: the stacked groups fuse) whose
    linears all take the stream path, at every row count."""
    from heterospec import Eagle3Draft, TargetModel
    from tests.engine_util import every_linear_streams, tiny_hf_llama
    every_linear_streams(monkeypatch, tmp_path)
    target = TargetModel.from_hf(tiny_hf_llama(vocab=96, hidden=64, heads=2, kv_heads=1, dtype=torch.float32))
    draft = Eagle3Draft.for_target(target, seed=1)
    with torch.no_grad():                      # larger weights: attention patterns matter
        for p in draft.parameters():
            if p.dim() > 1:
                p.mul_(5.0)
    L.tune_linears([target, draft], progress=False)
    return target, draft


def _round(target, draft, streamed: bool, cache_len: int = 40, hole=None, depths: int = 4, k: int = 3,
           Ls=(10, 6)):
    """Extend over two prompts (``Ls``: their lengths of 10 tokens, the shorter padded), then
    ``depths`` tree steps of ``k`` random nodes with random parents on the layer above; returns
    the outputs, the tree state and the ops run."""
    B, Ls = 2, list(Ls)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 96, (B, 10), generator=g)
    old = DM.STREAMED_DRAFT
    DM.STREAMED_DRAFT = streamed
    try:
        with torch.inference_mode():
            _, feats = target(ids, torch.arange(10).expand(B, 10), target.new_cache(B, 10),
                              torch.zeros(B, dtype=torch.long))
        with torch.inference_mode(), torch.profiler.profile() as prof:
            cache = draft.new_cache(B, cache_len)
            h = draft.extend(ids, feats, cache, torch.zeros(B, dtype=torch.long), torch.tensor(Ls))
            prefix = torch.tensor(Ls)
            h_root = h[torch.arange(B), prefix - 1]
            state = draft.new_tree(B)
            outs, layer = [], []
            for depth in range(1, depths + 1):
                toks = torch.randint(0, 96, (B, k), generator=g)
                if depth == 1:
                    par, hid = torch.full((B, k), -1), h_root[:, None].expand(B, k, -1)
                else:
                    pick = torch.randint(0, k, (B, k), generator=g)
                    par = state.num_nodes - k + pick
                    hid = layer.gather(1, pick[..., None].expand(B, k, layer.shape[-1]))
                layer = draft.tree_step(toks, hid, par, prefix[:, None] + depth - 1 + torch.zeros(B, k, dtype=torch.long),
                                        cache, prefix, state, hole)
                outs.append(layer)
            logits = draft.logits(layer)
    finally:
        DM.STREAMED_DRAFT = old
    valid = torch.cat([h[0, :Ls[0]], h[1, :Ls[1]]])
    return [valid, *outs, logits], state, {e.name for e in prof.events()}


def test_streamed_steps_give_the_modules_results(pair):
    target, draft = pair
    want, ref_state, names = _round(target, draft, streamed=False)
    assert "heterospec::tree_attention" not in names and not ref_state.cached
    got, state, names = _round(target, draft, streamed=True)
    assert "heterospec::tree_attention" in names and state.cached and state.kbuf is None
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, **TOL)
    assert torch.equal(state.anc, ref_state.anc)
    torch.testing.assert_close(state.k, ref_state.k, **TOL)
    torch.testing.assert_close(state.v, ref_state.v, **TOL)


@pytest.mark.parametrize("Ls", [(10, 6), (10, 10)])
def test_the_layer_as_one_op_gives_the_same_bits(pair, monkeypatch, Ls):
    """decoder_layer_ (no input norm, the draft's own residual, the tree's earlier columns before
    the new rows) against the streamed layer call by call: the same hidden states, logits, cache
    and tree. A padded extend (10, 6) writes only real rows, so it stays call by call."""
    target, draft = pair
    monkeypatch.setattr(DM, "LAYER_OP", False)
    want, ref_state, names = _round(target, draft, streamed=True, Ls=Ls)
    assert "heterospec::decoder_layer_" not in names
    monkeypatch.setattr(DM, "LAYER_OP", True)
    got, state, names = _round(target, draft, streamed=True, Ls=Ls)
    assert "heterospec::decoder_layer_" in names
    for w, g in zip(want, got):
        assert torch.equal(g, w)
    assert torch.equal(state.anc, ref_state.anc)
    assert torch.equal(state.k, ref_state.k) and torch.equal(state.v, ref_state.v)


def test_a_round_out_of_free_slots_goes_on_in_the_compact_layout(pair):
    """Cache of 17 slots, prefixes 10 and 6, 3 nodes a step: the third step's nodes (slots 16-18
    of the first request) do not fit, so the nodes so far move to buffers of their own."""
    target, draft = pair
    want, ref_state, _ = _round(target, draft, streamed=False, cache_len=17)
    got, state, names = _round(target, draft, streamed=True, cache_len=17)
    assert "heterospec::tree_attention" in names
    assert not state.cached and state.kbuf is not None and state.num_nodes == 12
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, **TOL)
    torch.testing.assert_close(state.k, ref_state.k, **TOL)


def test_a_hole_or_autograd_keeps_the_modules(pair):
    target, draft = pair
    hole = torch.tensor([[2, 5], [0, 0]])
    want, _, _ = _round(target, draft, streamed=False, hole=hole)
    got, state, _ = _round(target, draft, streamed=True, hole=hole)
    assert not state.cached
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, **TOL)
    with torch.inference_mode():
        assert draft._streamed(4) is not None
    with torch.enable_grad():
        assert draft._streamed(4) is None


def test_a_changed_weight_is_never_served_from_kept_calls(pair):
    _, draft = pair
    x = torch.randn(1, 4, 64)
    with torch.inference_mode():
        assert draft._streamed(4).lm_head is not None
    with torch.no_grad():
        draft.lm_head.weight.mul_(0.5)         # written in place: the packed copies are stale
    with torch.inference_mode():
        plan = draft._streamed(4)
        assert plan is None or plan.lm_head is None
        want = torch.nn.functional.linear(draft.norm(x), draft.lm_head.weight)
        torch.testing.assert_close(draft.logits(x), want, **TOL)


@pytest.mark.parametrize("method", ["eagle3", "heterospec"])
def test_greedy_decoding_with_streamed_draft_steps_is_lossless(pair, method, monkeypatch):
    from heterospec import Engine, SpecConfig
    from heterospec.entropy import EntropyBins
    target, draft = pair
    eng = Engine(target, draft, config=SpecConfig(top_k=3, depth=3, total_tokens=8),
                 bins=EntropyBins([0.5, 1.0, 2.0, 3.0]))
    calls = []
    real = draft._streamed_layer
    monkeypatch.setattr(draft, "_streamed_layer", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = [[1, 5, 9, 14, 3, 7], [4, 8, 15, 16, 23, 42, 11, 12, 13]]
    for p in prompts:
        want = eng.generate(p, max_new_tokens=24, method="autoregressive", chat=False).token_ids
        got = eng.generate(p, max_new_tokens=24, method=method, chat=False, policy="paper")
        assert got.token_ids == want and got.stats.rounds > 0
    outs = eng.generate_batch(prompts, max_new_tokens=24, method=method, chat=False, policy="paper")
    for p, o in zip(prompts, outs):
        assert o.token_ids == eng.generate(p, max_new_tokens=24, method="autoregressive", chat=False).token_ids
    assert calls, "the streamed draft steps were never taken"


def test_the_cost_model_fingerprint_names_how_the_draft_runs(pair, monkeypatch):
    """A cost model measured with the draft's modules running (slower rounds), or for a draft of
    another MLP width, is reported, never reused."""
    from heterospec import Engine
    from heterospec.costmodel import fingerprint, fingerprint_differences
    target, draft = pair
    eng = Engine(target, draft)
    on = fingerprint(eng)
    monkeypatch.setattr(DM, "STREAMED_DRAFT", False)
    off = fingerprint(eng)
    assert on["draft_layers"] == "streamed" and off["draft_layers"] == "modules"
    assert any(d.startswith("draft_layers:") for d in fingerprint_differences(off, on))
    assert on["draft"]["intermediate"] == draft.config.intermediate_size
