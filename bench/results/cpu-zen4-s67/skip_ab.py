"""In-process A/B of the lookup gate's back-off (LookupGate.SKIP_MAX) at batch B, float32:
heterospec with each setting and autoregressive, alternated per group of prompts."""
import sys, time, torch, heterospec, functools
from heterospec import lookup
from heterospec.bench import load_prompt_sets
from clocks import Timers, forward_clock
torch.set_num_threads(2)
B = int(sys.argv[1]); n = int(sys.argv[2]); alt = int(sys.argv[3]) if len(sys.argv) > 3 else 16
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
inside = forward_clock(eng)
ps = [p.text for s in load_prompt_sets(["mtbench", "alpaca"], n // 2).values() for p in s]
groups = [ps[i:i + B] for i in range(0, len(ps), B)]
variants = {"skip4": 4, f"skip{alt}": alt, "AR": None}
eng.generate_batch(groups[0], max_new_tokens=16); eng.generate_batch(groups[0], max_new_tokens=16, method="autoregressive")
tot = {v: [0.0, 0.0, 0, 0, 0] for v in variants}
for i, g in enumerate(groups):
    names = list(variants) if i % 2 == 0 else list(variants)[::-1]
    for v in names:
        if variants[v] is not None:
            lookup.LookupGate.SKIP_MAX = variants[v]
        inside[0] = 0.0
        t = time.perf_counter()
        rs = eng.generate_batch(g, max_new_tokens=96, method="autoregressive" if v == "AR" else "heterospec")
        dt = time.perf_counter() - t
        T = tot[v]; T[0] += dt; T[1] += inside[0]; T[2] += sum(len(r.token_ids) for r in rs)
        recs = rs[0].stats.records
        T[3] += len(recs) if recs else max(len(r.token_ids) for r in rs)
        T[4] += sum(1 for x in recs if x.lookup)
ar = tot["AR"][2] / tot["AR"][0]
for v, (w, f, ntok, rounds, looks) in tot.items():
    print(f"batch {B} {v:7s} {ntok/w:6.1f} tok/s ({ntok/w/ar:.3f}x AR)  host {1e3*(w-f)/rounds:.3f} ms/round, "
          f"{rounds} rounds, {looks} lookup rounds (request 0)")
