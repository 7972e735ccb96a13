"""A bfloat16 target streamed as its GGUF codes (rounded to bfloat16 in registers) against the same
target streamed as bfloat16 weights (loaded with linear.BLOCK_CODES off): a forward at context 256
with 1-8 rows, arms alternated, best of 30; the same logits asserted."""
import time
import torch
import heterospec.models.linear as L
from heterospec import Engine
from heterospec.models.linear import block_codes
torch.set_num_threads(2)
arms = {}
L.BLOCK_CODES = False
arms["bf16 weights"] = Engine.from_pretrained(dtype=torch.bfloat16).target
L.BLOCK_CODES = True
arms["codes"] = Engine.from_pretrained(dtype=torch.bfloat16).target
for name, tgt in arms.items():
    lins = [m for m in tgt.modules() if isinstance(m, torch.nn.Linear)]
    print(name, ": linears streamed as codes", sum(block_codes(m) is not None for m in lins), "of", len(lins))
ctx = 256
caches = {k: t.new_cache(1, 1024) for k, t in arms.items()}
with torch.inference_mode():
    ids0 = torch.randint(0, 1000, (1, ctx))
    for k, t in arms.items():
        t.forward(ids0, torch.arange(ctx)[None], caches[k], torch.zeros(1, dtype=torch.long))
    for rows in (1, 2, 4, 8):
        ids = torch.randint(0, 1000, (1, rows)); pos = torch.arange(ctx, ctx + rows)[None]; pl = torch.tensor([ctx])
        outs, best = {}, {}
        for r in range(30):
            for k, t in arms.items():
                t0 = time.perf_counter(); o = t.forward(ids, pos, caches[k], pl); dt = time.perf_counter() - t0
                best[k] = min(best.get(k, 1e9), dt); outs[k] = o
        same = all(torch.equal(a, b) for a, b in zip(outs["bf16 weights"], outs["codes"]))
        print("rows %d: bf16 weights %.2f ms, codes %.2f ms, %.3fx, same logits: %s"
              % (rows, best["bf16 weights"] * 1e3, best["codes"] * 1e3, best["codes"] / best["bf16 weights"], same))
