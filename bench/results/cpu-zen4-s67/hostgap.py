"""Host time per token outside the models' forwards: autoregressive vs heterospec, interleaved
per prompt (float32, batch 1, mtbench + alpaca openings, 96 tokens)."""
import time, torch, heterospec, sys, functools, collections
from heterospec.bench import load_prompt_sets
from clocks import Timers, forward_clock
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(dtype=getattr(torch, sys.argv[1]))
inside = forward_clock(eng)
sets = load_prompt_sets(["mtbench", "alpaca"], int(sys.argv[2]) if len(sys.argv) > 2 else 8)
ps = [p.text for s in sets.values() for p in s]
methods = ("autoregressive", "heterospec")
for m in methods: eng.generate(ps[0], max_new_tokens=16, method=m)
tot = {m: [0.0, 0.0, 0, 0] for m in methods}    # wall, inside forwards, tokens, rounds
for i, p in enumerate(ps):
    for m in (methods if i % 2 == 0 else methods[::-1]):
        inside[0] = 0.0
        t = time.perf_counter(); r = eng.generate(p, max_new_tokens=96, method=m); dt = time.perf_counter() - t
        T = tot[m]; T[0] += dt; T[1] += inside[0]; T[2] += len(r.token_ids); T[3] += max(len(r.stats.records), len(r.token_ids) if m == "autoregressive" else 0)
for m, (w, f, n, rounds) in tot.items():
    print(f"{m:15s} {n/w:6.1f} tok/s  {1e3*w/n:.3f} ms/token: forwards {1e3*f/n:.3f}, host {1e3*(w-f)/n:.3f} ms/token "
          f"({1e3*(w-f)/rounds:.3f} ms/round, {rounds} rounds)")
print(f"heterospec/AR = {(tot['heterospec'][2]/tot['heterospec'][0])/(tot['autoregressive'][2]/tot['autoregressive'][0]):.3f}")
