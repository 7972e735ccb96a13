import time, torch, statistics
from heterospec import Engine, ops
from heterospec.models.linear import tune_linears
eng = Engine.from_pretrained(dtype=torch.float32)
for k, v in eng.linear_report.items():
    if k.startswith("fused"): print(k, v["fused_rows"])
target = eng.target
ctx = 256
cache = target.new_cache(1, ctx + 40)
with torch.inference_mode():
    target(torch.randint(0, 49152, (1, ctx)), torch.arange(ctx)[None], cache, torch.zeros(1, dtype=torch.int64), None, None, return_features=False)
    prefix = torch.full((1,), ctx, dtype=torch.int64)
    res = {}
    for r in range(6):
        for mode in (("nofuse", "fuse") if r % 2 else ("fuse", "nofuse")):
            tune_linears([eng.target, eng.draft], fuse=mode == "fuse")
            for T in (1, 4, 8, 12):
                parents = torch.tensor([[-1] + [max(0, (i - 1) // 2) for i in range(1, T)]]); num = torch.tensor([T])
                mask, pos, _, _ = ops.build_tree(parents, num, prefix)
                toks = torch.randint(0, 49152, (1, T))
                ts = []
                for _ in range(6):
                    t0 = time.perf_counter(); target(toks, pos, cache, prefix, mask, num, return_features=True); ts.append(time.perf_counter() - t0)
                res.setdefault((mode, T), []).append(min(ts))
for T in (1, 4, 8, 12):
    o, n = min(res[("nofuse", T)]), min(res[("fuse", T)])
    print(T, "nofuse %.2f ms fuse %.2f ms  fuse/nofuse %.3f" % (1e3 * o, 1e3 * n, n / o))
