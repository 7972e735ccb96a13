"""Layer linears at 1-6 rows with a temporary build switch (argument: its environment variable; HS_MAGIC = exponent-trick widening, HS_MR3 = three rows in one pass) against the shipped kernels, in-process, best of 12, equal outputs asserted. The switches are not in the shipped code."""
import torch, time, os, sys
from heterospec import Engine
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
env = sys.argv[1] if len(sys.argv) > 1 else "HS_MAGIC"
calls = {}
for rows in (1, 2, 3, 4, 6):
    cl = [c for sl in tgt._build_stream_plans(rows, torch.float32) for c in sl.qkv + [sl.o_proj] + sl.gate_up + [sl.down]]
    xs = {c.args[0].shape[1]: torch.randn(rows, c.args[0].shape[1]) for c in cl}
    calls[rows] = (cl, xs)
best = {}
with torch.inference_mode():
    for rows, (cl, xs) in calls.items():
        outs = []
        for arm in (0, 1):
            if arm: os.environ[env] = "1"
            else: os.environ.pop(env, None)
            outs.append([c.op(xs[c.args[0].shape[1]], *c.args) for c in cl])
        assert all(torch.equal(a, b) for a, b in zip(*outs)), rows
    for r in range(12):
        for arm in (0, 1):
            if arm: os.environ[env] = "1"
            else: os.environ.pop(env, None)
            for rows, (cl, xs) in calls.items():
                t = time.perf_counter()
                for c in cl: c.op(xs[c.args[0].shape[1]], *c.args)
                dt = time.perf_counter() - t
                best[(arm, rows)] = min(best.get((arm, rows), 1e9), dt)
for rows in calls:
    h, o = best[(0, rows)], best[(1, rows)]
    print("rows %d: base %.2f ms, %s %.2f ms, %.3fx" % (rows, h * 1e3, env, o * 1e3, o / h))
