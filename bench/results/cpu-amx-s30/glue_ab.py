import time, torch, statistics
from heterospec import Engine, ops
from heterospec.models import kv_cache, attention
eng = Engine.from_pretrained(dtype=torch.float32)
target = eng.target
new_write, new_plan = kv_cache.KVCache.write, attention.SdpaAttention.plan
def old_write(self, layer, k_new, v_new, prefix_lens, num_valid=None):
    B, T = k_new.shape[:2]
    j = torch.arange(T); slots = prefix_lens[:, None] + j; b_idx = torch.arange(B)[:, None].expand(B, T)
    kc, vc = self.k[layer], self.v[layer]
    kc[b_idx, slots] = k_new; vc[b_idx, slots] = v_new
def old_plan(self, tree_mask, prefix_lens, cache, n_heads, scale):
    T = tree_mask.shape[1]; S = cache.max_length
    width = min(S, int(prefix_lens.max()) + T); self.scale = scale
    return attention.SdpaPlan(ops.dense_tree_attention_mask(tree_mask.contiguous(), prefix_lens, width), width)
ctx = 256
cache = target.new_cache(1, ctx + 40)
with torch.inference_mode():
    target(torch.randint(0, 49152, (1, ctx)), torch.arange(ctx)[None], cache, torch.zeros(1, dtype=torch.int64), None, None, return_features=False)
    prefix = torch.full((1,), ctx, dtype=torch.int64)
    res = {}
    for r in range(6):
        for mode in (("old", "new") if r % 2 else ("new", "old")):
            kv_cache.KVCache.write = new_write if mode == "new" else old_write
            attention.SdpaAttention.plan = new_plan if mode == "new" else old_plan
            for T in (1, 8):
                parents = torch.tensor([[-1] + [max(0, (i - 1) // 2) for i in range(1, T)]]); num = torch.tensor([T])
                mask, pos, _, _ = ops.build_tree(parents, num, prefix)
                toks = torch.randint(0, 49152, (1, T))
                ts = []
                for _ in range(8):
                    t0 = time.perf_counter(); target(toks, pos, cache, prefix, mask, num, return_features=True); ts.append(time.perf_counter() - t0)
                res.setdefault((mode, T), []).append(min(ts))
for T in (1, 8):
    o, n = min(res[("old", T)]), min(res[("new", T)])
    print(T, "old %.2f ms new %.2f ms  new/old %.3f" % (1e3 * o, 1e3 * n, n / o))
