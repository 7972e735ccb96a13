"""The target's forward over T tokens (batch 1, context 256) and its batch-B one-token step (context
256 each), float32, with and without this session's widened block kernels, interleaved per call in one
process: needs a build with the temporary switch HS_EXP_NO_WIDEN (read per call; not in the product).
Median of REPS calls per arm and shape.  Usage: python step_inproc.py REPS"""
import os, statistics, sys, time, torch, heterospec
torch.set_num_threads(2)
reps = int(sys.argv[1])
e = heterospec.Engine.from_pretrained()
t = e.target
def setup(B, T):
    cache = e._new_cache(t, B, 1024)
    ids = torch.randint(0, 1000, (B, 256))
    t(ids, torch.arange(256)[None].expand(B, -1), cache, torch.zeros(B, dtype=torch.long), None, None, return_features=False)
    L = torch.full((B,), 256)
    x = torch.randint(0, 1000, (B, T))
    pos = L[:, None] + torch.arange(T)[None]
    return lambda: t(x, pos, cache, L, None, None, return_features=True, taps=e._taps)
shapes = [(1, 4), (1, 8), (1, 12), (1, 16), (1, 24), (1, 32), (8, 1), (16, 1)]
with torch.inference_mode():
    for B, T in shapes:
        f = setup(B, T)
        f(); f()
        res = {"old": [], "new": []}
        for i in range(reps):
            for a in (("old", "new") if i % 2 else ("new", "old")):
                if a == "old": os.environ["HS_EXP_NO_WIDEN"] = "1"
                else: os.environ.pop("HS_EXP_NO_WIDEN", None)
                t0 = time.perf_counter(); f(); res[a].append(time.perf_counter() - t0)
        o, n = statistics.median(res["old"]), statistics.median(res["new"])
        print(f"B={B:2d} T={T:2d} ({B*T:2d} rows): before {1e3*o:7.2f} ms  widened {1e3*n:7.2f} ms  ratio {n/o:.3f}", flush=True)
