"""Eagle3Draft: public checkpoint layout round trips, exact ancestor masking in tree_step,
forward_train (training-time test) vs the inference path, bad input. Tiny random models (CPU)."""

from __future__ import annotations

import json

import copy

import pytest
import torch
from safetensors.torch import load_file

from heterospec.models import DraftConfig, Eagle3Draft, TargetModel
from heterospec.models.draft import AUX_CONVENTION, aux_layers_from_ids
from models_util import tiny_llama

ATOL, RTOL = 1e-5, 1e-4  # float32


def _i64(*xs):
    return torch.tensor(xs, dtype=torch.long)


def _close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


@pytest.fixture(scope="module")
def target():
    return TargetModel.from_hf(tiny_llama(vocab=103, hidden=48, layers=6, heads=6, kv_heads=2, seed=3))


@pytest.fixture(scope="module")
def draft(target):
    gen = torch.Generator().manual_seed(0)
    kept = torch.randperm(103, generator=gen)[:37]
    d = Eagle3Draft.for_target(target, kept_ids=kept, seed=1)
    with torch.no_grad():  # larger weights so that attention patterns matter
        for n, p in d.named_parameters():
            if p.dim() > 1:
                p.mul_(5.0)
    return d


def _features(target, B, T, seed=0):
    ids = torch.randint(0, target.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        _, feats = target(ids, torch.arange(T).expand(B, T), target.new_cache(B, T), torch.zeros(B, dtype=torch.long))
    return ids, feats


# ---------------------------------------------------------------------------------------------
# Construction, maps


def test_for_target_shapes_and_maps(target, draft):
    c = draft.config
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (48, 6, 2, 8)
    assert c.vocab_size == 103 and c.draft_vocab_size == 37 and c.target_hidden_size == 48
    assert draft.fc.weight.shape == (48, 144)
    assert draft.midlayer.self_attn.q_proj.weight.shape == (48, 96)
    assert draft.embedding is target.embed_tokens
    assert "embed_tokens.weight" not in draft.state_dict()
    assert draft.t2d.sum() == 37
    tid = draft.to_target_ids(torch.arange(37))
    assert bool(draft.t2d[tid].all()) and bool((tid[1:] > tid[:-1]).all())
    assert draft.to_target_ids(_i64(-1, 0))[0] == -1
    full = Eagle3Draft.for_target(target)
    assert full.config.draft_vocab_size == 103 and bool((full.d2t == 0).all()) and bool(full.t2d.all())
    # HF model as target
    hf = tiny_llama(vocab=50, hidden=32, layers=4, heads=4, kv_heads=4)
    d = Eagle3Draft.for_target(hf, draft_vocab_size=20)
    assert d.embedding is hf.get_input_embeddings() and d.config.draft_vocab_size == 20
    assert d.aux_layers() is None and d.aux_layers(4) == (2, 2, 1) and draft.aux_layers(32) == (2, 16, 29)


# ---------------------------------------------------------------------------------------------
# Checkpoint layout


def _outputs(d, target):
    ids, feats = _features(target, 2, 7, seed=5)
    cache = d.new_cache(2, 8)
    h = d.extend(ids, feats, cache, _i64(0, 0), _i64(7, 7))
    return d.logits(h)


def test_save_load_roundtrip_public_layout(tmp_path, target, draft):
    draft.save_pretrained(tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 37 and cfg["vocab_size"] == 103 and cfg["num_hidden_layers"] == 1
    sd = load_file(tmp_path / "model.safetensors")
    assert set(sd) == {
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
        *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
    }
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and sd["lm_head.weight"].shape == (37, 48)
    loaded = Eagle3Draft.from_pretrained(tmp_path, target=target)
    assert loaded.embedding is target.embed_tokens and loaded.dtype == torch.float32
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    _close(_outputs(loaded, target), _outputs(draft, target))
    # default shipping dtype: float16
    draft.save_pretrained(tmp_path / "f16")
    assert load_file(tmp_path / "f16" / "model.safetensors")["fc.weight"].dtype == torch.float16
    assert json.loads((tmp_path / "f16" / "config.json").read_text())["torch_dtype"] == "float16"
    l16 = Eagle3Draft.from_pretrained(tmp_path / "f16", target=target)
    assert l16.dtype == torch.float32  # follows the target
    torch.testing.assert_close(_outputs(l16, target), _outputs(draft, target), atol=0.05, rtol=0.01)


def test_pytorch_model_bin_with_embed_tokens(tmp_path, target, draft):
    sd = {k: v.clone() for k, v in draft.state_dict().items()}
    sd["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    torch.save(sd, tmp_path / "pytorch_model.bin")
    cfg = draft.config.to_dict()
    cfg.pop("rope_theta")  # the public 8B config has none: 10000 is implied
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = Eagle3Draft.from_pretrained(tmp_path)  # own embedding: no target needed
    assert loaded.embed_tokens is not None and "embed_tokens.weight" in loaded.state_dict()
    assert loaded.config.rope == {}
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    _close(loaded.rotary.inv_freq, inv)
    _close(_outputs(loaded, target), _outputs(draft, target))
    loaded.save_pretrained(tmp_path / "re", dtype=None)
    assert "embed_tokens.weight" in load_file(tmp_path / "re" / "model.safetensors")


def test_no_embedding_without_target_is_a_clear_error(tmp_path, target, draft):
    draft.save_pretrained(tmp_path, dtype=torch.float32)
    loaded = Eagle3Draft.from_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="no embed_tokens"):
        loaded.extend(_i64(1)[None], torch.zeros(1, 1, 144), loaded.new_cache(1, 4), _i64(0), _i64(1))
    loaded.attach(target)
    assert loaded.embedding is target.embed_tokens


def test_full_vocab_without_maps_and_aux_layer_ids(tmp_path, target):
    d = Eagle3Draft.for_target(target, seed=2)
    d.save_pretrained(tmp_path, dtype=torch.float32)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["d2t"], sd["t2d"]
    from safetensors.torch import save_file

    save_file(sd, tmp_path / "model.safetensors")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 2, 4], AUX_CONVENTION: "output"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t2 = TargetModel.from_hf(tiny_llama(vocab=103, hidden=48, layers=6, heads=6, kv_heads=2, seed=3))
    loaded = Eagle3Draft.from_pretrained(tmp_path, target=t2)
    assert bool((loaded.d2t == 0).all()) and bool(loaded.t2d.all())
    assert loaded.aux_layers() == (1, 3, 5) and t2.config.aux_layers == (1, 3, 5)
    # written back in vLLM's reading (the inputs of the layers), saying so
    eagle = json.loads(json.dumps(loaded.config.to_dict()))["eagle_config"]
    assert eagle == {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], AUX_CONVENTION: "input"}
    assert DraftConfig.from_dict(loaded.config.to_dict()).aux_layers == (1, 3, 5)


def test_aux_layer_ids_are_read_as_vllm_and_sglang_read_them():
    """vLLM reads eagle_aux_hidden_state_layer_ids as the inputs of those layers, SGLang's
    checkpoints (first id 1) as their outputs; an explicit key decides over that rule."""
    assert aux_layers_from_ids([2, 15, 27]) == (2, 15, 27)                    # vLLM's reading
    assert aux_layers_from_ids([1, 14, 26]) == (2, 15, 27)                    # SGLang's (first id 1)
    assert aux_layers_from_ids([1, 14, 26], "input") == (1, 14, 26)
    assert aux_layers_from_ids([0, 3, 6], "output") == (1, 4, 7)
    assert aux_layers_from_ids([0, 3, 6]) == (0, 3, 6)
    with pytest.raises(ValueError, match=AUX_CONVENTION):
        aux_layers_from_ids([2, 3], "before")
    with pytest.raises(ValueError, match=AUX_CONVENTION):
        DraftConfig.from_dict({"hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10, "intermediate_size": 16,
                               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], AUX_CONVENTION: 1}})


def test_the_shipped_drafts_layer_ids_are_the_layers_it_was_trained_on():
    """The shipped draft was trained on the inputs of target layers 2, 15, 27 (the EAGLE-3
    default for 30 layers); its config names them so that vLLM, which takes the ids as they
    stand, feeds it those layers too (it was fed 1, 14, 26 before: bench/RESULTS.md, sixty-ninth
    session)."""
    from heterospec.defaults import DRAFT_ASSET_DIR

    cfg = json.loads((DRAFT_ASSET_DIR / "config.json").read_text())
    ids = tuple(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    assert ids == DraftConfig.from_dict(cfg).aux_layers == (2, 30 // 2, 30 - 3)


def test_engine_feeds_the_draft_its_own_taps(tmp_path):
    """A draft naming its own tap layers gets exactly those features, however the target was built
    (in-memory transformers model, a TargetModel attached to another draft), and a later draft with
    default taps does not inherit them."""
    from heterospec import Engine

    hf = tiny_llama(vocab=103, hidden=48, layers=8, heads=6, kv_heads=2, seed=4)
    tm = TargetModel.from_hf(hf)
    custom = Eagle3Draft.for_target(tm, seed=5)
    custom.save_pretrained(tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 4, 7], AUX_CONVENTION: "input"}   # taps (1, 4, 7)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    custom = Eagle3Draft.from_pretrained(tmp_path, target=TargetModel.from_hf(hf))
    default = Eagle3Draft.for_target(tm, seed=6)

    ids = torch.randint(0, 103, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states     # [i] enters layer i

    def fed_features(engine):
        seen = []
        extend = engine.draft.extend

        def spy(tokens, feats, *a, **k):
            seen.append(feats)
            return extend(tokens, feats, *a, **k)
        engine.draft.extend = spy
        try:
            engine.generate(ids[0].tolist(), max_new_tokens=2, method="eagle3")
        finally:
            del engine.draft.extend
        return torch.cat(seen[:2], dim=1)      # the prompt (at prefill), then the first round's entry

    def expected(layers):
        return torch.cat([hidden[i] for i in layers], dim=-1)    # entry p: feature p, token p + 1

    for engine in (Engine(hf, custom), Engine(tm, custom)):
        f = fed_features(engine)
        torch.testing.assert_close(f, expected((1, 4, 7)), atol=1e-4, rtol=1e-4)
    default.attach(tm)                    # after custom taps were set on tm by from_pretrained/attach
    assert tm.config.aux_layers == (2, 4, 5)
    f = fed_features(Engine(tm, default))
    torch.testing.assert_close(f, expected((2, 4, 5)), atol=1e-4, rtol=1e-4)


def test_narrower_draft_with_own_embedding(tmp_path, target):
    """target_hidden_size != hidden_size, head_dim from the config, GQA ratio 4, own embed_tokens."""
    cfg = DraftConfig(hidden_size=32, intermediate_size=80, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=16, vocab_size=103, draft_vocab_size=103, target_hidden_size=48,
                      rope={"rope_theta": 50000.0})
    d = Eagle3Draft(cfg, own_embedding=True)
    assert d.fc.weight.shape == (32, 144) and d.midlayer.self_attn.q_proj.weight.shape == (128, 64)
    d.save_pretrained(tmp_path, dtype=torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["target_hidden_size"] == 48
    loaded = Eagle3Draft.from_pretrained(tmp_path, target=target)
    assert loaded.embed_tokens is not None and loaded.config.head_dim == 16
    _close(_outputs(loaded, target), _outputs(d, target))


def test_bf16_smoke(target):
    d = Eagle3Draft.for_target(target, draft_vocab_size=40, dtype=torch.bfloat16)
    assert d.dtype == torch.bfloat16 and d.d2t.dtype == torch.int64 and d.t2d.dtype == torch.bool
    ids, feats = _features(target, 2, 6)
    cache = d.new_cache(2, 12)
    h = d.extend(ids, feats, cache, _i64(0, 0), _i64(6, 4))
    assert h.dtype == torch.bfloat16 and cache.k.dtype == torch.bfloat16
    state = d.new_tree(2)
    out = d.tree_step(ids[:, :3], h[:, -1:].expand(2, 3, 48), torch.full((2, 3), -1), torch.full((2, 3), 6),
                      cache, _i64(6, 4), state)
    assert torch.isfinite(d.logits(out)).all() and d.logits(out).dtype == torch.float32
    assert torch.isfinite(d.forward_train(ids, feats, ttt_steps=2).logits[1]).all()


# ---------------------------------------------------------------------------------------------
# Inference: extend and tree_step


def test_extend_padding_and_batches(target, draft):
    """Batch with different committed lengths and padded rows == each request alone."""
    ids, feats = _features(target, 2, 12, seed=7)
    cache = draft.new_cache(2, 16)
    draft.extend(ids[:, :6], feats[:, :6], cache, _i64(0, 0), _i64(6, 3))  # request 1: 3 + 3 padding
    h = draft.extend(ids[:, 6:], feats[:, 6:], cache, _i64(6, 3), _i64(6, 2))
    for b, (n1, n2) in enumerate([(6, 6), (3, 2)]):
        c1 = draft.new_cache(1, 16)
        x_ids = torch.cat([ids[b, :n1], ids[b, 6:6 + n2]])[None]
        x_feat = torch.cat([feats[b, :n1], feats[b, 6:6 + n2]])[None]
        ref = draft.extend(x_ids, x_feat, c1, _i64(0), _i64(n1 + n2))
        _close(h[b, :n2], ref[0, n1:])
        _close(cache.k[:, b, : n1 + n2], c1.k[:, 0, : n1 + n2])
    assert bool((cache.k[0, 1, 5:] == 0).all())  # padding rows were never written


@pytest.mark.parametrize("static", [False, True])
def test_cache_slots_in_a_hole_are_never_read(target, draft, static):
    """A request's hole [lo, hi) (the engine's draft_window: slots whose entries were dropped
    from a long catch-up) is masked in extend and in both tree layouts: whatever those slots
    hold, the outputs are the same; the same garbage outside a hole changes them."""
    B, k = 2, 3
    ids, feats = _features(target, B, 14, seed=21)
    hole = torch.tensor([[3, 7], [0, 0]])          # request 1: no hole

    def run(garbage, hole):
        cache = draft.new_cache(B, 24)
        draft.extend(ids[:, :10], feats[:, :10], cache, _i64(0, 0), _i64(10, 10))
        if garbage:
            g = torch.Generator().manual_seed(4)
            cache.k[:, 0, 3:7] = 50 * torch.randn(cache.k[:, 0, 3:7].shape, generator=g)
            cache.v[:, 0, 3:7] = 50 * torch.randn(cache.v[:, 0, 3:7].shape, generator=g)
        h = draft.extend(ids[:, 10:], feats[:, 10:], cache, _i64(10, 10), _i64(4, 4), hole)
        prefix = _i64(14, 14)
        state = draft.new_tree(B, static=static)
        x = h[:, -1:].expand(B, k, -1)
        outs = [h]
        for depth in range(1, 3):
            par = torch.full((B, k), -1) if depth == 1 else torch.tensor([[0, 1, 2], [2, 2, 0]])
            x = draft.tree_step(ids[:, depth:depth + k], x, par, (prefix[:, None] + depth - 1).expand(B, k),
                                cache, prefix, state, hole)
            outs.append(x)
        return outs

    for a, b in zip(run(False, hole), run(True, hole)):
        _close(a, b)
    no_hole = torch.zeros(2, 2, dtype=torch.long)
    changed = [not torch.allclose(a[0], b[0], atol=1e-3) for a, b in zip(run(False, no_hole), run(True, no_hole))]
    assert all(changed)
    # the hole is masked, not ignored: request 0 differs from its hole-free run, request 1 does not
    for a, b in zip(run(False, hole), run(False, no_hole)):
        assert not torch.allclose(a[0], b[0], atol=1e-3)
        _close(a[1], b[1])


@pytest.mark.parametrize("static,capacity", [(False, None), (True, None), (True, 4), (False, 5)])
def test_tree_step_exact_ancestor_masking(target, draft, static, capacity):
    """Every tree node's hidden equals running its root-to-node path through extend alone, in
    both tree layouts (compact: CPU default; static: the CUDA layout with float masks and expanded
    KV heads), including buffers that grow mid-round (capacity 4 or 5 for 12 nodes)."""
    B = 2
    ids, feats = _features(target, B, 10, seed=9)
    Ls = [10, 6]
    cache = draft.new_cache(B, 24)
    h = draft.extend(ids, feats, cache, _i64(0, 0), torch.tensor(Ls))
    prefix = torch.tensor(Ls)
    h_root = h[torch.arange(B), prefix - 1]  # [B, H]
    gen = torch.Generator().manual_seed(3)
    state = draft.new_tree(B, static=static, capacity=capacity)
    nodes = [[] for _ in range(B)]  # per request: (token, parent_slot, depth, hidden)
    k = 3
    for depth in range(1, 5):
        toks = torch.randint(0, 103, (B, k), generator=gen)
        par = torch.full((B, k), -1, dtype=torch.long)
        hid = h_root[:, None].expand(B, k, -1).clone()
        if depth > 1:
            for b in range(B):
                cand = [i for i, n in enumerate(nodes[b]) if n[2] == depth - 1]
                for j in range(k):
                    p = cand[int(torch.randint(0, len(cand), (1,), generator=gen))]
                    par[b, j] = p
                    hid[b, j] = nodes[b][p][3]
        pos = prefix[:, None] + depth - 1
        out = draft.tree_step(toks, hid, par, pos.expand(B, k), cache, prefix, state)
        for b in range(B):
            for j in range(k):
                nodes[b].append((int(toks[b, j]), int(par[b, j]), depth, out[b, j]))
    assert state.num_nodes == 12 and state.anc.shape == (B, 12, 12) and state.static == static
    heads = draft.config.num_attention_heads if static else draft.config.num_key_value_heads
    assert state.k.shape == (B, 12, heads, draft.config.head_dim)
    for b in range(B):
        for i, (tok, _, depth, hidden) in enumerate(nodes[b]):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = nodes[b][j][1]
            path = path[::-1]
            c1 = draft.new_cache(1, 24)
            c1.k[:, 0] = cache.k[:, b]
            c1.v[:, 0] = cache.v[:, b]
            x = h_root[b][None, None]
            for d, j in enumerate(path):  # one entry at a time, feeding back its own output
                x = draft.extend(_i64(nodes[b][j][0])[None], x, c1, _i64(Ls[b] + d), _i64(1))
            _close(hidden, x[0, 0])


def test_kernel_friendly_attention_matches_on_cpu(target, draft):
    """The CUDA formulation (expanded KV heads, additive float masks, static tree buffers) gives
    the CPU results; the default CPU path is unchanged (bool masks, enable_gqa)."""
    from heterospec.models.layers import sdpa, sdpa_kernel_friendly

    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(3, 4, 6, 8, generator=g), torch.randn(3, 9, 2, 8, generator=g), torch.randn(3, 9, 2, 8, generator=g)
    mask = torch.rand(3, 4, 9, generator=g) < 0.6
    mask[..., 0] = True
    _close(sdpa_kernel_friendly(q, k, v, mask, 0.3), sdpa(q, k, v, mask, 0.3))

    B, k = 2, 3
    ids, feats = _features(target, B, 10, seed=13)
    prefix = _i64(10, 7)
    outs = []
    for kf in (None, True):
        draft.kernel_friendly_attention = kf
        try:
            cache = draft.new_cache(B, 20)
            h = draft.extend(ids, feats, cache, _i64(0, 0), prefix)
            state = draft.new_tree(B)
            x = h[torch.arange(B), prefix - 1][:, None].expand(B, k, -1)
            steps = [h]
            for depth in range(1, 4):
                par = torch.full((B, k), -1) if depth == 1 else torch.tensor([[0, 1, 2], [2, 2, 0]]) + (depth - 2) * k
                x = draft.tree_step(ids[:, depth:depth + k], x, par, (prefix[:, None] + depth - 1).expand(B, k),
                                    cache, prefix, state)
                steps.append(x)
            assert state.static == bool(kf)
            outs.append(steps)
        finally:
            draft.kernel_friendly_attention = None
    for a, b in zip(*outs):
        _close(b, a)


def test_static_tree_buffers_are_static_and_recycled(target, draft):
    """Static layout: the same key count every step, 16-aligned, and the same storage next round."""
    B, k, S = 2, 3, 21
    ids, feats = _features(target, B, 8, seed=14)
    cache = draft.new_cache(B, S)
    h = draft.extend(ids, feats, cache, _i64(0, 0), _i64(8, 5))
    ptrs = []
    for _ in range(2):  # two rounds
        state = draft.new_tree(B, static=True, capacity=10)
        x = h[:, :k]
        for depth in range(1, 4):
            par = torch.full((B, k), -1) if depth == 1 else torch.arange(k).expand(B, k) + (depth - 2) * k
            x = draft.tree_step(ids[:, :k], x, par, torch.full((B, k), 7 + depth), cache, _i64(8, 5), state)
            assert state.kbuf.shape[1] == S + state.capacity and (S + state.capacity) % 16 == 0
        assert state.capacity == 11 and state.num_nodes == 9
        ptrs.append(state.kbuf.data_ptr())
    assert ptrs[0] == ptrs[1]


# ---------------------------------------------------------------------------------------------
# Training-time test


def test_forward_train_matches_inference(target, draft):
    B, S = 2, 10
    ids, feats = _features(target, B, S, seed=11)
    out = draft.forward_train(ids, feats, ttt_steps=3)
    assert len(out.logits) == 3 and out.logits[0].shape == (B, S, 37) and out.logits[0].dtype == torch.float32
    # step 0 == extend over (features[p], ids[p + 1])
    cache = draft.new_cache(B, S)
    h0 = draft.extend(ids[:, 1:], feats[:, :-1], cache, _i64(0, 0), _i64(S - 1, S - 1))
    _close(out.hidden[0][:, : S - 1], h0)
    _close(out.logits[0][:, : S - 1], draft.logits(h0))
    # step s, row p == a chain of tree steps after committing entries 0..p
    for p in (0, 3, 6):
        L = p + 1
        state = draft.new_tree(B)
        x = h0[:, p : p + 1]
        for s in range(1, 3):
            par = torch.full((B, 1), -1 if s == 1 else s - 2, dtype=torch.long)
            x = draft.tree_step(ids[:, p + 1 + s : p + 2 + s], x, par, torch.full((B, 1), L + s - 1), cache,
                                torch.full((B,), L), state)
            _close(out.hidden[s][:, p], x[:, 0])


def test_forward_train_padding_and_grad(target, draft):
    B, S = 2, 8
    ids, feats = _features(target, B, S, seed=12)
    am = torch.ones(B, S, dtype=torch.long)
    am[1, 5:] = 0
    out = draft.forward_train(ids, feats, attention_mask=am, ttt_steps=2)
    ref = draft.forward_train(ids[1:, :5], feats[1:, :5], ttt_steps=2)
    for s in range(2):
        assert torch.isfinite(out.hidden[s]).all()
        _close(out.hidden[s][1, : 4 - s], ref.hidden[s][0, : 4 - s])  # rows whose token ids[p+1+s] < 5
    loss = sum(l.logsumexp(-1).mean() for l in out.logits)
    loss.backward()
    assert draft.fc.weight.grad is not None and target.embed_tokens.weight.grad is None
    draft.zero_grad(set_to_none=True)
    out = draft.forward_train(ids, feats, ttt_steps=2, return_logits=False)
    assert out.logits == [] and len(out.hidden) == 2


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_inputs(tmp_path, target, draft):
    with pytest.raises(FileNotFoundError, match="not found"):
        Eagle3Draft.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Eagle3Draft.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(draft.config.to_dict())[:-2])
    with pytest.raises(ValueError, match=r"EAGLE-3 draft config .*config.json is not valid JSON"):
        Eagle3Draft.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(draft.config.to_dict()))
    with pytest.raises(FileNotFoundError, match="model.safetensors or pytorch_model.bin"):
        Eagle3Draft.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture: qwen2"):
        DraftConfig.from_dict({**draft.config.to_dict(), "model_type": "qwen2"})
    # attaching to a target of another hidden size / vocabulary
    other_h = TargetModel.from_hf(tiny_llama(vocab=103, hidden=32, layers=4, heads=4, kv_heads=2))
    other_v = TargetModel.from_hf(tiny_llama(vocab=90, hidden=48, layers=4, heads=6, kv_heads=2))
    draft.save_pretrained(tmp_path / "d", dtype=torch.float32)
    with pytest.raises(ValueError, match="hidden-size mismatch"):
        Eagle3Draft.from_pretrained(tmp_path / "d", target=other_h)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        Eagle3Draft.from_pretrained(tmp_path / "d", target=other_v)
    # reduced vocabulary without maps
    sd = load_file(tmp_path / "d" / "model.safetensors")
    del sd["d2t"]
    from safetensors.torch import save_file

    save_file(sd, tmp_path / "d" / "model.safetensors")
    with pytest.raises(KeyError, match="d2t"):
        Eagle3Draft.from_pretrained(tmp_path / "d", target=target)
    # extend longer than the cache / past its end; wrong feature width
    ids, feats = _features(target, 1, 6)
    with pytest.raises(ValueError, match="max_length"):
        draft.extend(ids, feats, draft.new_cache(1, 5), _i64(0), _i64(6))
    with pytest.raises(ValueError, match="max_length"):
        draft.extend(ids[:, :3], feats[:, :3], draft.new_cache(1, 5), _i64(3), _i64(3))
    with pytest.raises(ValueError, match="width"):
        draft.extend(ids, feats[..., :100], draft.new_cache(1, 8), _i64(0), _i64(6))
    with pytest.raises(ValueError, match="parent_slots"):
        st = draft.new_tree(1)
        draft.tree_step(ids[:, :2], torch.zeros(1, 2, 48), _i64(-1, 0)[None], _i64(6, 6)[None],
                        draft.new_cache(1, 8), _i64(0), st)


def test_q8_0_weights_need_float32(target):
    d = Eagle3Draft.for_target(target, seed=2)
    ref = {n: p.detach().clone() for n, p in d.named_parameters()}
    with pytest.raises(ValueError, match="float32"):
        copy.deepcopy(d).to(torch.bfloat16).round_weights_q8_0_()
    assert d.round_weights_q8_0_() is d and d.weight_form == "q8_0"
    for n, p in d.named_parameters():
        moved = not torch.equal(p, ref[n])
        # every linear whose input width is a multiple of 32 is rounded; norms and the rest are not
        assert moved == (p.dim() == 2 and p.shape[1] % 32 == 0 and "embed" not in n), n
