import torch, time, sys
from heterospec import Engine
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
eng = Engine.from_pretrained()
tgt = eng.target
cache = tgt.new_cache(1, 1024)
ctx = 256
rows = int(sys.argv[1])
OP = torch.ops.heterospec.decoder_layer_.default
ATT = torch.ops.heterospec.tree_attention.default
with torch.inference_mode():
    ids = torch.randint(0, 1000, (1, ctx))
    tgt.forward(ids, torch.arange(ctx)[None], cache, torch.zeros(1, dtype=torch.long))
    ids = torch.randint(0, 1000, (1, rows)); pos = torch.arange(ctx, ctx + rows)[None]
    plans = tgt._build_stream_plans(rows, torch.float32)
    H = tgt.config.hidden_size
    x = torch.randn(1, rows, H); out = torch.empty_like(x)
    cos, sin = tgt.rotary(pos, x.dtype)
    pl = torch.tensor([ctx]); mask = torch.tril(torch.ones(rows, rows, dtype=torch.bool))[None]
    q = torch.randn(1, rows, 9, 64)
    lins = [(c, torch.randn(rows, c.args[0].shape[1])) for sl in plans for c in sl.qkv + [sl.o_proj] + sl.gate_up + [sl.down]]
    def fwd(): tgt.forward(ids, pos, cache, pl, return_features=False)
    def ops():
        for i, sl in enumerate(plans):
            OP(x, sl.norm1, sl.eps1, sl.norm2, sl.eps2, sl.layer_op[0], sl.layer_op[1], cos, sin, pl, mask, 0.125, out, cache.k[i], cache.v[i])
    def lin():
        for c, xx in lins: c.op(xx, *c.args)
    def att():
        for i in range(30): ATT(q, cache.k[i], cache.v[i], pl, mask, 0.125)
    def head(): tgt.lm_head(x)
    fns = dict(fwd=fwd, ops=ops, lin=lin, att=att, head=head)
    best = {}
    for r in range(25):
        for k, f in fns.items():
            t = time.perf_counter(); f(); best[k] = min(best.get(k, 1e9), time.perf_counter() - t)
    print(rows, {k: round(v * 1e3, 2) for k, v in best.items()})
