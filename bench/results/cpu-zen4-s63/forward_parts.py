"""Where a float32 one-token forward of the built-in target goes (context 256), side by side, medians
of 300 alternations: the whole forward, the layers op alone (decoder_layers_ with the forward's
arguments), the head (final norm + lm_head), and the forward's other parts one by one."""
import time
import torch
from heterospec import Engine
from heterospec.models import target as TG
from heterospec.models import linear as LN
from heterospec.models.linear import settled_weights
torch.set_num_threads(2)
torch.set_grad_enabled(False)
eng = Engine.from_pretrained()
t, c = eng.target, eng.target.config
cache = t.new_cache(1, 1024)
t(torch.randint(0, 40000, (1, 256)), torch.arange(256)[None], cache, torch.zeros(1, dtype=torch.long))
one, p1, pl = torch.tensor([[5]]), torch.tensor([[256]]), torch.tensor([256])
t(one, p1, cache, pl)
x = t.embed_tokens(one)
stack = t._stream_plans(x).stack
cos, sin = t.rotary(p1, x.dtype)
plan = t.backend.plan(TG.causal_tree_mask(1, 1, x.device), pl, cache, c.num_heads, c.head_dim ** -0.5)
out, feats = torch.empty_like(x), x.new_empty(1, 1, 0)


def layers():
    torch.ops.heterospec.decoder_layers_.default(x, *stack, cos, sin, plan.prefix_lens, plan.tree_mask, plan.scale,
                                                 [], out, feats, cache.k, cache.v)


def outside(f):
    """f as outside an engine call (every forward checks the weights)."""
    def g():
        kept, LN._SETTLED.epoch = LN._SETTLED.epoch, None
        try:
            f()
        finally:
            LN._SETTLED.epoch = kept
    return g


parts = {
    "forward (outside an engine call)": outside(lambda: t(one, p1, cache, pl)),
    "layers op": layers,
    "head (norm + lm_head)": lambda: t.lm_head(t.norm(out)),
    "check_fits": lambda: cache.check_fits(pl, 1, "target forward"),
    "causal mask": lambda: TG.causal_tree_mask(1, 1, one.device),
    "attention plan": lambda: t.backend.plan(plan.tree_mask, pl, cache, c.num_heads, c.head_dim ** -0.5),
    "embedding": lambda: t.embed_tokens(one),
    "rotary": lambda: t.rotary(p1, torch.float32),
    "stream plans (weights checked)": outside(lambda: t._stream_plans(x)),
}
with settled_weights():
    t._stream_plans(x)
    parts["forward (in an engine call)"] = lambda: t(one, p1, cache, pl)
    parts["stream plans (settled)"] = lambda: t._stream_plans(x)
    res = {k: [] for k in parts}
    for _ in range(300):
        for k, f in parts.items():
            s = time.perf_counter(); f(); res[k].append(time.perf_counter() - s)
for k, v in res.items():
    v.sort()
    print(f"{k:34s} median {1e6 * v[len(v) // 2]:8.1f} us   min {1e6 * v[0]:8.1f} us")
