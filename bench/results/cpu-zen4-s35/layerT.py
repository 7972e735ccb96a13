import time, torch, timeit
from heterospec.engine import Engine
from heterospec.models import target as TM
from heterospec.models.layers import rope_qk
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
cache = tgt.new_cache(1, 1024)
norm = torch.ops.heterospec.rms_norm.default
with torch.inference_mode():
    tgt(torch.randint(0, 40000, (1, 300)), torch.arange(300)[None], cache, torch.zeros(1, dtype=torch.long), return_features=False)
    pl = torch.tensor([300]); hl = [300]
    for T in (1, 4, 8):
        x = torch.randn(1, T, 576); pos = pl[:, None] + torch.arange(T)[None]
        plans = tgt._stream_plans(x); L = plans[3]
        cos, sin = tgt.rotary(pos, x.dtype)
        tm = torch.tril(torch.ones(1, T, T, dtype=torch.bool))
        backend = tgt.backend; plan = backend.plan(tm, pl, cache, 9, 64**-0.5)
        n = 1000
        h = norm(x, L.norm1, L.eps1)
        q, k, v = (o for c in L.qkv for o in c(h))
        qq, kk = rope_qk(q.view(1, T, 9, 64), k.view(1, T, 3, 64), cos, sin)
        o = backend.run(plan, qq, cache.k[3], cache.v[3])
        g, u = (o2 for c in L.gate_up for o2 in c(h))
        a = torch.nn.functional.silu(g) * u
        parts = [("layer", lambda: L(x, cos, sin, cache, 3, pl, hl, backend, plan)),
                 ("qkv", lambda: [c(h) for c in L.qkv]),
                 ("rope", lambda: rope_qk(q.view(1, T, 9, 64), k.view(1, T, 3, 64), cos, sin)),
                 ("write", lambda: cache.write(3, kk, v.view(1, T, 3, 64), pl, host_lens=hl)),
                 ("attn", lambda: backend.run(plan, qq, cache.k[3], cache.v[3])),
                 ("o", lambda: L.o_proj(o.flatten(-2))),
                 ("gate_up", lambda: [c(h) for c in L.gate_up]), ("silu*up", lambda: torch.nn.functional.silu(g) * u),
                 ("down", lambda: L.down(a)), ("lm_head", lambda: tgt.lm_head(x)), ("plan", lambda: backend.plan(tm, pl, cache, 9, 64**-0.5)), ("rotary", lambda: tgt.rotary(pos, x.dtype))]
        print(f"T={T} " + "  ".join(f"{name} {timeit.timeit(fn, number=n)/n*1e6:.1f}" for name, fn in parts))
