"""The lookup gate's longest back-off (LookupGate.SKIP_MAX) A/B at batch B, float32: autoregressive,
heterospec with the shipped cap and with a longer one, arms rotated per group of prompts in one
process (the gate's state is shared; only the cap differs per call). Measurement only."""
import os, sys, time, torch, heterospec
from heterospec.bench import load_prompt_sets
from heterospec.lookup import LookupGate
torch.set_num_threads(2)
B, n, cap = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
sets = sys.argv[4].split(",") if len(sys.argv) > 4 else ["mtbench", "alpaca", "humaneval", "gsm"]
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
ps = [p.text for s in load_prompt_sets(sets, n // len(sets)).values() for p in s]
groups = [ps[i:i + B] for i in range(0, len(ps), B)]
shipped = LookupGate.SKIP_MAX
ARMS = [("autoregressive", shipped), ("heterospec", shipped), ("heterospec", cap)]
for m, c in ARMS: eng.generate_batch(groups[0], max_new_tokens=16, method=m)
tot = {a: [0.0, 0, 0] for a in ARMS}
asks = {a: 0 for a in ARMS}
due = LookupGate.due
for gi, g in enumerate(groups):
    for j in range(len(ARMS)):
        a = ARMS[(gi + j) % len(ARMS)]
        LookupGate.SKIP_MAX = a[1]
        count = [0]
        def counted(self, bucket=1, _f=due, _c=count):
            d = _f(self, bucket); _c[0] += d; return d
        LookupGate.due = counted
        t = time.perf_counter(); rs = eng.generate_batch(g, max_new_tokens=96, method=a[0]); dt = time.perf_counter() - t
        LookupGate.due = due
        tot[a][0] += dt; tot[a][1] += sum(len(r.token_ids) for r in rs)
        tot[a][2] += sum(1 for r in rs for rec in r.stats.records if rec.lookup)
        asks[a] += count[0]
LookupGate.SKIP_MAX = shipped
base = tot[ARMS[0]][1] / tot[ARMS[0]][0]
print(f"batch {B}, {len(ps)} prompts ({','.join(sets)}), SKIP_MAX {shipped} vs {cap}")
for a, (w, ntok, lk) in tot.items():
    print(f"  {a[0]:15s} SKIP_MAX={a[1]:3d} {ntok / w:6.1f} tok/s ({ntok / w / base:.3f}x), lookup request-rounds {lk}, gate asks {asks[a]}")
