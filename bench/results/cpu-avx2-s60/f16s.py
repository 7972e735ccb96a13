"""float32 against float16 scales for the target layer linears (a temporary build that took float16 scales; not shipped)."""
import torch, time
from heterospec import Engine, ops
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
calls = {}
for rows in (1, 2, 4):
    cl = [c for sl in tgt._build_stream_plans(rows, torch.float32) for c in sl.qkv + [sl.o_proj] + sl.gate_up + [sl.down]]
    xs = {c.args[0].shape[1]: torch.randn(rows, c.args[0].shape[1]) for c in cl}
    calls[rows] = (cl, xs)
half = {id(c): c.args[1].half() for c in calls[1][0]}
for rows in calls:
    cl = calls[rows][0]
    for c in cl: half.setdefault(id(c), c.args[1].half())
assert all(torch.equal(c.args[1].half().float(), c.args[1]) for c in calls[1][0])
best = {}
with torch.inference_mode():
    for r in range(12):
        for arm in ("f32 scales", "f16 scales"):
            for rows, (cl, xs) in calls.items():
                t = time.perf_counter()
                for c in cl:
                    a = list(c.args)
                    if arm == "f16 scales": a[1] = half[id(c)]
                    c.op(xs[c.args[0].shape[1]], *a)
                best[(arm, rows)] = min(best.get((arm, rows), 1e9), time.perf_counter() - t)
    for rows, (cl, xs) in calls.items():
        c = cl[0]; x = xs[c.args[0].shape[1]]
        same = torch.equal(c.op(x, *c.args), c.op(x, c.args[0], half[id(c)], *c.args[2:]))
        print("rows %d: f32 scales %.2f ms, f16 scales %.2f ms (%.3fx), same bits %s" % (rows, best[("f32 scales", rows)] * 1e3, best[("f16 scales", rows)] * 1e3, best[("f16 scales", rows)] / best[("f32 scales", rows)], same))
