"""tok/s of autoregressive (twice: the second arm says what the noise is), heterospec and heterospec without lookup rounds (lookup=False) at
batch B, float32, arms rotated per group of prompts in one process; host time per round
outside the models' forwards. Measurement only."""
import os, sys, time, torch, heterospec
from heterospec.bench import load_prompt_sets, paired_ratio_interval
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cpu-zen4-s67"))
from clocks import forward_clock
torch.set_num_threads(2)
B = int(sys.argv[1]); n = int(sys.argv[2]) if len(sys.argv) > 2 else 32
sets = sys.argv[3].split(",") if len(sys.argv) > 3 else ["mtbench", "alpaca"]
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
inside = forward_clock(eng)
ps = [p.text for s in load_prompt_sets(sets, n // len(sets)).values() for p in s]
groups = [ps[i:i + B] for i in range(0, len(ps), B)]
ARMS = [("autoregressive", None), ("heterospec", None), ("heterospec", False), ("autoregressive", "again")]
for m, lk in ARMS: eng.generate_batch(groups[0], max_new_tokens=16, method=m, lookup=lk if isinstance(lk, bool) else None)
tot = {a: [0.0, 0.0, 0, 0, 0] for a in ARMS}
units = []
outs = {}
for i, g in enumerate(groups):
    units.append({"tokens": {}, "wall_s": {}})
    for j in range(len(ARMS)):
        a = ARMS[(i + j) % len(ARMS)]
        inside[0] = 0.0
        t = time.perf_counter(); rs = eng.generate_batch(g, max_new_tokens=96, method=a[0], lookup=a[1] if isinstance(a[1], bool) else None); dt = time.perf_counter() - t
        units[-1]["tokens"][str(a)], units[-1]["wall_s"][str(a)] = sum(len(r.token_ids) for r in rs), dt
        T = tot[a]; T[0] += dt; T[1] += inside[0]; T[2] += sum(len(r.token_ids) for r in rs)
        T[3] += max(r.stats.target_calls for r in rs)
        T[4] += sum(1 for r in rs for rec in r.stats.records if not rec.plain)
        outs.setdefault(i, []).append([r.token_ids for r in rs])
same = all(all(o == v[0] for o in v) for v in outs.values())
base = tot[ARMS[0]][2] / tot[ARMS[0]][0]
print(f"batch {B}, {len(ps)} prompts ({','.join(sets)}), greedy outputs identical across arms: {same}")
for a, (w, f, ntok, calls, spec) in tot.items():
    print(f"  {a[0]:15s} lookup={str(a[1]):5s} {ntok / w:6.1f} tok/s ({ntok / w / base:.3f}x)  target calls {calls}, "
          f"[90 % {paired_ratio_interval(units, str(a), str(ARMS[0]))}] non-plain request-rounds {spec}, host {1e3 * (w - f) / calls:.3f} ms/call, forwards {1e3 * f / calls:.2f} ms/call")
