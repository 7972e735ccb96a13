"""tree_attention, one layer of the built-in target (9 query heads, 3 KV heads, D 64), B requests x T rows
after L cached tokens: phase 3 over pairs of rows for the common prefix's blocks and prefetches from the first
row of a block only ("first"), against every row alone and every row prefetching ("all": the kernel before).
Run on a build with a temporary switch (HS_ALL_HINT=1 took the old loops; read per call, removed before the
commit), both arms interleaved 6x in one process; the least median of 80 calls and the median of the paired
ratios first / all (time, below 1 = faster)."""
import os, statistics, time, torch, heterospec
torch.set_num_threads(2)
op = torch.ops.heterospec.tree_attention
for dt in (torch.float32, torch.bfloat16):
  for B, T, L in ((1, 1, 300), (1, 8, 300), (1, 16, 300), (8, 1, 300), (8, 8, 300)):
    k = torch.randn(B, L + 64, 3, 64, dtype=dt); q = torch.randn(B, T, 9, 64, dtype=dt); v = torch.randn_like(k)
    lens = torch.full((B,), L); mask = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T).contiguous()
    res = {}
    for rep in range(6):
        for arm in ("first", "all"):
            os.environ["HS_ALL_HINT"] = "1" if arm == "all" else "0"
            ts = []
            for i in range(100):
                t0 = time.perf_counter(); op(q, k, v, lens, mask, 0.125); ts.append(time.perf_counter() - t0)
            res.setdefault(arm, []).append(statistics.median(ts[20:]))
    r = [a / b for a, b in zip(res["first"], res["all"])]
    print(dt, B, T, L, {a: f"{1e6*min(x):.1f}" for a, x in res.items()}, "first/all median", round(statistics.median(r), 3), flush=True)
