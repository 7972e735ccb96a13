"""A target forward (context 256, 1-8 rows, causal) with its layers as one decoder_layers_ call
(STACK_OP) against one decoder_layer_ call per layer, in one process, arms alternated, best of 40;
the same logits and features asserted."""
import time
import torch
import heterospec.models.target as T
from heterospec import Engine
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
cache = tgt.new_cache(1, 1024)
ctx = 256
with torch.inference_mode():
    tgt.forward(torch.randint(0, 1000, (1, ctx)), torch.arange(ctx)[None], cache, torch.zeros(1, dtype=torch.long))
    for rows in (1, 2, 4, 8):
        ids = torch.randint(0, 1000, (1, rows)); pos = torch.arange(ctx, ctx + rows)[None]; pl = torch.tensor([ctx])
        outs, best = {}, {}
        for r in range(40):
            for arm in ("per layer", "stack"):
                T.STACK_OP = arm == "stack"
                t = time.perf_counter(); o = tgt.forward(ids, pos, cache, pl); dt = time.perf_counter() - t
                best[arm] = min(best.get(arm, 1e9), dt); outs[arm] = o
        assert all(torch.equal(a, b) for a, b in zip(outs["per layer"], outs["stack"]))
        print("rows %d: per layer %.2f ms, stack %.2f ms, %.3fx (same logits and features)"
              % (rows, best["per layer"] * 1e3, best["stack"] * 1e3, best["stack"] / best["per layer"]))
