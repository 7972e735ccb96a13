# A/B: target forward with the tree_attention op (CPU_TREE_ATTENTION) vs SDPA + dense mask, alternating per forward
import time, torch, statistics, sys
from heterospec import Engine
import heterospec.models.attention as A
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
ids = eng._encode("Write a short poem about the sea and the sky, in the style of an old sailor.", True)
for P0 in [int(a) for a in sys.argv[1:]] or [300]:
    ids_p = (ids * 40)[:P0]
    cache = tgt.new_cache(1, 1024)
    with torch.inference_mode():
        tgt(torch.tensor([ids_p]), torch.arange(P0)[None], cache, torch.tensor([0]))
        for T in (1, 8):
            x = torch.tensor([ids_p[:T]]); pos = torch.arange(P0, P0 + T)[None]; pl = torch.tensor([P0])
            mask = torch.ones(1, T, T, dtype=torch.bool).tril()
            ts = {False: [], True: []}
            for i in range(120):
                on = bool(i % 2)
                A.CPU_TREE_ATTENTION = on
                t = time.perf_counter(); tgt(x, pos, cache, pl, tree_mask=mask); ts[on].append(time.perf_counter() - t)
            ratios = [b / a for a, b in zip(ts[False], ts[True])]
            a, b = statistics.median(ts[False]) * 1e3, statistics.median(ts[True]) * 1e3
            print(f"context {P0}, T={T}: sdpa {a:.2f} ms, tree_attention {b:.2f} ms, ratio of medians {b/a:.3f}, median pair ratio {statistics.median(ratios):.3f}")
