"""Run against this session's temporary build whose tree_attention read the prefetch distance from HS_PFK (0: none) once a call; the switch is not in the shipped code (kPrefetchKeys = 16). A target forward at context 64 / 256 / 1024, 1-8 rows, arms alternated, best of 40, the same logits asserted."""
import torch, time, os, sys
from heterospec import Engine
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
cache = tgt.new_cache(1, 2048)
arms = sys.argv[1:] or ["0", "8", "16", "32"]
with torch.inference_mode():
  for ctx in (64, 256, 1024):
    tgt.forward(torch.randint(0, 1000, (1, ctx)), torch.arange(ctx)[None], cache, torch.zeros(1, dtype=torch.long))
    for rows in (1, 2, 4, 8):
        ids = torch.randint(0, 1000, (1, rows)); pos = torch.arange(ctx, ctx + rows)[None]; pl = torch.tensor([ctx])
        outs, best = {}, {}
        for r in range(40):
            for arm in arms:
                os.environ["HS_PFK"] = arm
                t = time.perf_counter(); o = tgt.forward(ids, pos, cache, pl); dt = time.perf_counter() - t
                best[arm] = min(best.get(arm, 1e9), dt); outs[arm] = o
        assert all(torch.equal(a, b) for arm in arms for a, b in zip(outs[arms[0]], outs[arm]))
        print("ctx %4d rows %d: " % (ctx, rows) + ", ".join("pf %s %.2f ms" % (a, best[a] * 1e3) for a in arms))
