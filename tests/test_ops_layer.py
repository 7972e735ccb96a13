"""decoder_layer_ (CPU) against a pure-PyTorch Llama layer, against the chain of heterospec ops it
replaces (bit for bit), in the target's forward, and its errors."""

import pytest
import torch
import torch.nn.functional as F

import heterospec.ops as ops
from reference import quantize_q8_0_ref, rms_norm_ref, rope_kv_write_ref, tree_attention_ref
from test_ops_linear import _errors

raw = torch.ops.heterospec


LAYOUTS = {"fused": (1, 1), "gate/up split": (1, 2), "qkv split": (3, 1), "both split": (3, 2)}


def _layer(B=2, T=3, H=64, Hq=4, Hkv=2, D=16, I=96, S=24, lens=(5, 0), fmt="q8_0", seed=0, layout="fused"):
    """Random weights (Q8_0 values, or float32 packed for stream_linear), inputs and caches;
    ``layout``: which linear groups run as one call (LAYOUTS)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [((Hq + 2 * Hkv) * D, H), (H, Hq * D), (2 * I, H), (H, I)]
    weights = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * k ** -0.5
        weights.append(quantize_q8_0_ref(w)[0] if fmt == "q8_0" else w)
    qkv_calls, gate_up_calls = LAYOUTS[layout]
    wqkv, wo, wgu, wd = weights
    calls = [*(wqkv.split([Hq * D, Hkv * D, Hkv * D]) if qkv_calls == 3 else [wqkv]), wo,
             *(wgu.split(I) if gate_up_calls == 2 else [wgu]), wd]
    linears = []
    for w in calls:
        if fmt == "q8_0":
            linears += ops.stream_linear_pack_blocks(w.contiguous())[1:]
        else:
            linears += [ops.stream_linear_pack(w.contiguous()), torch.empty(0)]
    x = torch.randn(B, T, H, generator=g)
    norms = (torch.rand(H, generator=g) + 0.5, torch.rand(H, generator=g) + 0.5)
    ang = torch.rand(B, T, D // 2, generator=g) * 50
    emb = torch.cat((ang, ang), -1)
    cos, sin = emb.cos(), emb.sin()
    lens = torch.tensor(lens)
    mask = torch.ones(B, T, T, dtype=torch.bool).tril()
    mask[0, 2, 1] = False                                        # a tree, not a chain, for request 0
    kc, vc = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    return dict(x=x, norms=norms, weights=weights, linears=linears, widths=[w.shape[0] for w in calls], cos=cos,
                sin=sin, lens=lens, mask=mask, kc=kc, vc=vc, Hq=Hq, I=I, D=D, layout=(qkv_calls, gate_up_calls))


def _reference(c):
    """The layer in plain PyTorch (float64 attention reference, F.linear on the weights' values)."""
    x, (n1, n2), (wqkv, wo, wgu, wd) = c["x"], c["norms"], c["weights"]
    q, kc, vc = rope_kv_write_ref(F.linear(rms_norm_ref(x, n1, 1e-5), wqkv), c["cos"], c["sin"], c["lens"], c["kc"],
                                  c["vc"], c["Hq"])
    o = tree_attention_ref(q, kc, vc, c["lens"], c["mask"], c["D"] ** -0.5)
    x1 = x + F.linear(o.flatten(-2), wo)
    g, u = F.linear(rms_norm_ref(x1, n2, 1e-6), wgu).split(c["I"], dim=-1)
    return x1 + F.linear(F.silu(g) * u, wd), kc, vc


def _op_chain(c):
    """What models.target.StreamedLayer runs call by call (each group fused or not, as laid out)."""
    x, (n1, n2) = c["x"], c["norms"]
    lin = c["linears"]
    qkv_calls, gate_up_calls = c["layout"]

    def linear(t, i):
        if lin[2 * i + 1].numel() == 0:
            return ops.stream_linear(t, lin[2 * i], None, c["widths"][i])
        return ops.stream_linear_blocks(t, lin[2 * i], lin[2 * i + 1], None, c["widths"][i])

    B, T, _ = x.shape
    kc, vc = c["kc"].clone(), c["vc"].clone()
    h = ops.rms_norm(x, n1, 1e-5)
    if qkv_calls == 1:
        q = torch.empty(B, T, c["Hq"], c["D"])
        ops.rope_kv_write_(linear(h, 0), c["cos"], c["sin"], c["lens"], q, kc, vc)
    else:                               # the layer's rope-then-write path for separate Q, K, V
        D = c["D"]
        q, k = ops.rope(linear(h, 0).view(B, T, -1, D), linear(h, 1).view(B, T, -1, D), c["cos"], c["sin"])
        v = linear(h, 2).view(B, T, -1, D)
        for b in range(B):
            n = int(c["lens"][b])
            kc[b, n:n + T], vc[b, n:n + T] = k[b], v[b]
    o = qkv_calls
    x1 = x + linear(ops.tree_attention(q, kc, vc, c["lens"], c["mask"], c["D"] ** -0.5).flatten(-2), o)
    h2 = ops.rms_norm(x1, n2, 1e-6)
    if gate_up_calls == 1:
        g, u = linear(h2, o + 1).split_with_sizes([c["I"], c["I"]], dim=-1)
    else:
        g, u = linear(h2, o + 1), linear(h2, o + 2)
    return x1 + linear(F.silu(g) * u, o + 1 + gate_up_calls), kc, vc


def _run(c, call=ops.decoder_layer_):
    out = torch.empty_like(c["x"])
    kc, vc = c["kc"].clone(), c["vc"].clone()
    call(c["x"], c["norms"][0], 1e-5, c["norms"][1], 1e-6, c["linears"], c["widths"], c["cos"], c["sin"], c["lens"],
         c["mask"], c["D"] ** -0.5, out, kc, vc)
    return out, kc, vc


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fmt", ["q8_0", "float32"])
@pytest.mark.parametrize("threads", [1, 2])
def test_decoder_layer_is_the_op_chain_bit_for_bit_and_the_reference(fmt, threads, layout):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        c = _layer(fmt=fmt, layout=layout)
        got = _run(c)
        for a, b in zip(got, _op_chain(c)):
            assert torch.equal(a, b)
        for a, b in zip(got, _reference(c)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("flag, op, fuse, off", [
    ("LAYER_OP", "decoder_layer_", True, {"STACK_OP": False}),     # one op a layer, groups fused
    ("LAYER_OP", "decoder_layer_", False, {"STACK_OP": False}),    # ... Q/K/V and gate/up separate
    ("STACK_OP", "decoder_layers_", True, {}),                     # the whole stack as one op
])
def test_the_target_runs_its_layers_as_one_op_with_the_same_bits(monkeypatch, flag, op, fuse, off):
    """A streamed float32 target forward takes decoder_layer_ per layer (also where Q/K/V and
    gate/up run as separate calls), or decoder_layers_ for all of them, with the logits, features
    and cache of the path without it: the layers call by call, or one op a layer."""
    from models_util import streamed_flag_ab

    runs = streamed_flag_ab(monkeypatch, flag, op, seed=8, fuse=fuse, off=off)
    if runs is None:
        pytest.skip("the tiny model's linears do not all stream fused here")
    (fused, cache_f), (plain, cache_p) = runs
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert torch.equal(cache_f.k, cache_p.k) and torch.equal(cache_f.v, cache_p.v)


@pytest.mark.parametrize("call", ["wrapper", "raw"])
def test_bad_input_gets_a_clear_error(call):
    fn = ops.decoder_layer_ if call == "wrapper" else (lambda *a: raw.decoder_layer_(*a))
    c = _layer()

    def run(**kw):
        a = dict(x=c["x"], n1=c["norms"][0], e1=1e-5, n2=c["norms"][1], e2=1e-6, lin=c["linears"], w=c["widths"],
                 cos=c["cos"], sin=c["sin"], lens=c["lens"], mask=c["mask"], scale=0.25, out=torch.empty_like(c["x"]),
                 kc=c["kc"].clone(), vc=c["vc"].clone())
        a.update(kw)
        return lambda: fn(*a.values())

    assert "x of dtype" in _errors(run(x=c["x"].double()))
    assert "[B, T, Hin]" in _errors(run(x=c["x"][0]))
    assert "8 linears" in _errors(run(lin=c["linears"][:6]))
    assert "4" in _errors(run(w=c["widths"][:3]))
    assert "out_features[0]" in _errors(run(w=[c["widths"][0] + 1] + c["widths"][1:]))
    assert "out_features[1]" in _errors(run(w=[c["widths"][0], 63, c["widths"][2], c["widths"][3]]))
    assert "out_features[2]" in _errors(run(w=c["widths"][:2] + [191, c["widths"][3]]))
    assert "x_out" in _errors(run(out=torch.empty(2, 3, 65)))
    assert "prefix_lens" in _errors(run(lens=torch.tensor([30, 0])))          # past the cache's 24 slots
    assert "tree_mask" in _errors(run(mask=c["mask"].int()))
    assert "cos" in _errors(run(cos=c["cos"][..., :8]))
    assert "linears[2]" in _errors(run(lin=c["linears"][:2] + [c["linears"][2][:, :8]] + c["linears"][3:]))
    kc, vc = c["kc"].clone(), c["vc"].clone()        # refused before anything is written
    for bad in (dict(mask=c["mask"].int()), dict(lens=torch.tensor([22, 0])), dict(lin=c["linears"][:6] + [
            c["linears"][6][:, :8], c["linears"][7]])):
        assert _errors(run(kc=kc, vc=vc, **bad))
    assert torch.equal(kc, c["kc"]) and torch.equal(vc, c["vc"])


@pytest.mark.parametrize("call", ["wrapper", "raw"])
def test_bad_split_layout_gets_a_clear_error(call):
    """Q/K/V and gate/up as separate calls: widths that do not make a layer are named."""
    fn = ops.decoder_layer_ if call == "wrapper" else (lambda *a: raw.decoder_layer_(*a))
    c = _layer(layout="both split")
    w = c["widths"]                                         # Q, K, V, O, gate, up, down

    def run(lin=c["linears"], widths=w):
        kc, vc = c["kc"].clone(), c["vc"].clone()
        return lambda: fn(c["x"], c["norms"][0], 1e-5, c["norms"][1], 1e-6, lin, widths, c["cos"], c["sin"], c["lens"],
                          c["mask"], 0.25, torch.empty_like(c["x"]), kc, vc)

    assert "14 linears" in _errors(run(lin=c["linears"][:12]))
    assert "out_features[0:3]" in _errors(run(widths=[w[0], w[1] + 16] + w[2:]))
    assert "(gate)" in _errors(run(widths=w[:4] + [w[4], w[5] - 32, w[6]]))
    assert "out_features[6] (down)" in _errors(run(widths=w[:6] + [63]))
    assert "4 to 7" in _errors(run(widths=w + [64]))


@pytest.mark.parametrize("call", ["wrapper", "raw"])
def test_the_draft_layout_no_input_norm_its_own_residual_and_earlier_tree_columns(call):
    """The EAGLE-3 draft's layer: x = [embedding, hidden] already normalised (2H wide, no norm1),
    the hidden state as residual, and a tree step's mask [B, T, C] whose first C - T columns are
    earlier nodes: the new rows are written at prefix_lens + C - T. Against the pure-PyTorch layer
    and the call-by-call chain, bit for bit."""
    fn = ops.decoder_layer_ if call == "wrapper" else (lambda *a: raw.decoder_layer_(*a))
    g = torch.Generator().manual_seed(3)
    B, T, C, H, Hq, Hkv, D, I, S = 2, 3, 5, 64, 4, 2, 16, 96, 24
    shapes = [((Hq + 2 * Hkv) * D, 2 * H), (H, Hq * D), (2 * I, H), (H, I)]
    weights = [quantize_q8_0_ref(torch.randn(n, k, generator=g) * k ** -0.5)[0] for n, k in shapes]
    linears = [t for w in weights for t in ops.stream_linear_pack_blocks(w)[1:]]
    x, res = torch.randn(B, T, 2 * H, generator=g), torch.randn(B, T, H, generator=g)
    n2 = torch.rand(H, generator=g) + 0.5
    ang = torch.rand(B, T, D // 2, generator=g) * 50
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    lens = torch.tensor([5, 0])
    mask = torch.rand(B, T, C, generator=g) < 0.6
    mask[:, :, C - T:] = torch.ones(T, T, dtype=torch.bool).tril()       # each new row sees itself
    kc, vc = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    widths = [w.shape[0] for w in weights]

    out, k1, v1 = torch.empty_like(res), kc.clone(), vc.clone()
    fn(x, None, 0.0, n2, 1e-6, linears, widths, cos, sin, lens, mask, D ** -0.5, out, k1, v1, res)

    # pure PyTorch: Q/K/V of x, K/V written after the earlier columns, attention, residual, MLP
    q, k2, v2 = rope_kv_write_ref(F.linear(x, weights[0]), cos, sin, lens + C - T, kc, vc, Hq)
    o = tree_attention_ref(q, k2, v2, lens, mask, D ** -0.5)
    x1 = res + F.linear(o.flatten(-2), weights[1])
    gg, u = F.linear(rms_norm_ref(x1, n2, 1e-6), weights[2]).split(I, dim=-1)
    want = x1 + F.linear(F.silu(gg) * u, weights[3])
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)

    # the chain of ops the draft runs call by call
    lin = lambda t, i: ops.stream_linear_blocks(t, linears[2 * i], linears[2 * i + 1], None, widths[i])
    k3, v3 = kc.clone(), vc.clone()
    qc = torch.empty(B, T, Hq, D)
    ops.rope_kv_write_(lin(x, 0), cos, sin, lens + C - T, qc, k3, v3)
    x1c = res + lin(ops.tree_attention(qc, k3, v3, lens, mask, D ** -0.5).flatten(-2), 1)
    gc, uc = lin(ops.rms_norm(x1c, n2, 1e-6), 2).split_with_sizes([I, I], dim=-1)
    assert torch.equal(out, x1c + lin(F.silu(gc) * uc, 3))
    assert torch.equal(k1, k3) and torch.equal(v1, v3)

    def err(**kw):
        a = dict(x=x, n1=None, e1=0.0, n2=n2, e2=1e-6, lin=linears, w=widths, cos=cos, sin=sin, lens=lens,
                 mask=mask, scale=0.25, out=torch.empty_like(res), kc=kc.clone(), vc=vc.clone(), res=res)
        a.update(kw)
        return _errors(lambda: fn(*a.values()))

    assert "residual" in err(res=res[:, :2])                                  # not x's [B, T]
    assert "C = " in err(mask=mask[:, :, :2])                                 # fewer columns than rows
    assert "prefix_lens" in err(lens=torch.tensor([20, 0]))                   # 20 + C past the 24 slots
    assert "linears[0]" in err(x=torch.randn(B, T, H))                        # QKV takes 2H


# ---- decoder_layers_: the whole stack in one call ------------------------------------------------

def _stack(fmt="q8_0", layouts=("fused", "qkv split", "both split")):
    """Layers of one shape and different call layouts, as decoder_layers_'s flat lists."""
    layers = [_layer(fmt=fmt, layout=lay, seed=10 + i) for i, lay in enumerate(layouts)]
    c = layers[0]
    return dict(layers=layers, x=c["x"], norms=[n for l in layers for n in l["norms"]],
                eps=[e for _ in layers for e in (1e-5, 1e-6)], linears=[t for l in layers for t in l["linears"]],
                widths=[w for l in layers for w in l["widths"]], calls=[len(l["widths"]) for l in layers],
                cos=c["cos"], sin=c["sin"], lens=c["lens"], mask=c["mask"], scale=c["D"] ** -0.5,
                kc=torch.stack([l["kc"] for l in layers]), vc=torch.stack([l["vc"] for l in layers]))


def _run_stack(s, taps, call=ops.decoder_layers_, **kw):
    B, T, H = s["x"].shape
    a = dict(x=s["x"], norms=s["norms"], eps=s["eps"], linears=s["linears"], widths=s["widths"], calls=s["calls"],
             cos=s["cos"], sin=s["sin"], lens=s["lens"], mask=s["mask"], scale=s["scale"], taps=list(taps),
             out=torch.empty(B, T, H), feats=torch.empty(B, T, len(taps) * H), kc=s["kc"].clone(),
             vc=s["vc"].clone())
    a.update(kw)
    assert call(*a.values()) is None
    return a["out"], a["feats"], a["kc"], a["vc"]


@pytest.mark.parametrize("fmt", ["q8_0", "float32"])
@pytest.mark.parametrize("threads", [1, 2])
def test_decoder_layers_is_decoder_layer_per_layer_bit_for_bit(fmt, threads):
    """Three layers (fused, Q/K/V split, both split) in one call: the output, the tapped hidden
    states (any order, the last output too) and every layer's cache are those of one
    decoder_layer_ call per layer, bit for bit."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        s = _stack(fmt)
        taps = [3, 0, 2, 0]
        out, feats, kc, vc = _run_stack(s, taps)
        h, states, ks, vs = s["x"], [], [], []
        for i, c in enumerate(s["layers"]):
            states.append(h)
            shared = {k: s[k] for k in ("cos", "sin", "lens", "mask")}
            nxt, k1, v1 = _run(dict(c, x=h, norms=(s["norms"][2 * i], s["norms"][2 * i + 1]), **shared))
            h = nxt
            ks.append(k1), vs.append(v1)
        states.append(h)
        assert torch.equal(out, h)
        assert torch.equal(feats, torch.cat([states[t] for t in taps], -1))
        assert torch.equal(kc, torch.stack(ks)) and torch.equal(vc, torch.stack(vs))
        out0, feats0, _, _ = _run_stack(s, [])
        assert torch.equal(out0, out) and feats0.shape == (*out.shape[:2], 0)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("call", ["wrapper", "raw"])
def test_decoder_layers_bad_input_gets_a_clear_error_and_writes_nothing(call):
    fn = ops.decoder_layers_ if call == "wrapper" else (lambda *a: raw.decoder_layers_(*a))
    s = _stack()
    w, lin = s["widths"], s["linears"]

    def err(taps=(1,), **kw):
        return _errors(lambda: _run_stack(s, taps, call=fn, **kw))

    assert "at least one layer" in err(calls=[], widths=[], linears=[], norms=[], eps=[])
    assert "layer_calls[1]" in err(calls=[4, 3, 7])
    assert "out_features (the sum of layer_calls)" in err(calls=[4, 6, 6])
    assert "linears tensors" in err(linears=lin[:-2])
    assert "2 L = 6 norms and eps" in err(norms=s["norms"][:5])
    assert "norms[3]" in err(norms=s["norms"][:3] + [s["norms"][3][:32]] + s["norms"][4:])
    assert "eps[2]" in err(eps=[1e-5, 1e-6, float("nan"), 1e-6, 1e-5, 1e-6])
    assert "[L, B, S, Hkv, D]" in err(kc=s["kc"][0])
    assert "L = layer_calls.size()" in err(kc=s["kc"][:2], vc=s["vc"][:2])
    assert "v_cache of k_cache's shape" in err(vc=s["vc"][:, :, :20])
    assert "taps" in err(taps=[4])
    assert "x_out" in err(out=torch.empty(2, 3, 32))
    assert "not x itself" in err(out=s["x"])
    assert "features [B, T, len(taps) * H]" in err(feats=torch.empty(2, 3, 128))
    assert "x of dtype" in err(x=s["x"].double())
    # a layer's own error names the layer, and no layer's cache was written
    kc, vc = s["kc"].clone(), s["vc"].clone()
    bad = w[:4] + [w[4] + 1] + w[5:]                     # layer 1's Q width (Q, K, V split)
    out, feats = torch.zeros(2, 3, 64), torch.zeros(2, 3, 64)
    msg = err(widths=bad, kc=kc, vc=vc, out=out, feats=feats)
    assert "decoder_layers_ (layer 1)" in msg and "out_features[0:3]" in msg
    assert "decoder_layers_ (layer 0)" in err(lens=torch.tensor([30, 0]), kc=kc, vc=vc, out=out, feats=feats)
    assert torch.equal(kc, s["kc"]) and torch.equal(vc, s["vc"])
    assert not out.any() and not feats.any()
