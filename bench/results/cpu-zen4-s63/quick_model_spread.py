"""The quick cost model measured several times in one process (float32, batch 1): the spread of the
ratios the fitted policy decides by - a two-token and a four-token target forward over a one-token
one, and a 2 / 3 / 4-node verify over a 1-node one - with the quick measurement's 5 passes and
with more (REPS)."""
import os, statistics, sys
import torch
from heterospec import Engine, costmodel
torch.set_num_threads(2)
eng = Engine.from_pretrained()
for reps in [int(r) for r in os.environ.get("REPS", "5 9").split()]:
    rows = []
    for i in range(int(os.environ.get("N", "6"))):
        cm = costmodel.measure(eng, quick=True, progress=False, repeats=reps)
        t, v = cm.target[0], cm.verify[0]
        rows.append((t[1] / t[0], t[2] / t[0], v[1] / v[0], v[2] / v[0], v[3] / v[0], t[0]))
    cols = list(zip(*rows))
    names = ("target 2/1", "target 4/1", "verify 2/1", "verify 3/1", "verify 4/1", "target 1 ms")
    print(f"passes {reps}: " + "; ".join(f"{n} {statistics.mean(c):.3f} (range {min(c):.3f}-{max(c):.3f})"
                                          for n, c in zip(names, cols)))
