"""The sixty-eighth session's plain-round host changes A/B at batch B (float32), in one process,
arms rotated per group: autoregressive; heterospec as shipped now (lookup gate's SKIP_MAX 32, plain
plans kept over PLAIN_REPLAN plain steps); heterospec as before (SKIP_MAX 4, a plan per step:
PLAIN_REPLAN 0, which also plans every round of a plain stretch in full). Measurement only."""
import sys, time, torch, heterospec
from heterospec.bench import load_prompt_sets
from heterospec.lookup import LookupGate
from heterospec.policy import FittedPolicy
torch.set_num_threads(2)
B, n = int(sys.argv[1]), int(sys.argv[2])
sets = sys.argv[3].split(",") if len(sys.argv) > 3 else ["mtbench", "alpaca", "humaneval", "gsm"]
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
ps = [p.text for s in load_prompt_sets(sets, n // len(sets)).values() for p in s]
groups = [ps[i:i + B] for i in range(0, len(ps), B)]
NOW = (LookupGate.SKIP_MAX, FittedPolicy.PLAIN_REPLAN)
ARMS = [("autoregressive", NOW), ("heterospec", NOW), ("heterospec", (4, 0))]
def setup(cfg):
    LookupGate.SKIP_MAX, FittedPolicy.PLAIN_REPLAN = cfg
for m, c in ARMS:
    setup(c); eng.generate_batch(groups[0], max_new_tokens=16, method=m)
tot = {i: [0.0, 0, 0] for i in range(len(ARMS))}
for gi, g in enumerate(groups):
    for j in range(len(ARMS)):
        i = (gi + j) % len(ARMS); setup(ARMS[i][1])
        t = time.perf_counter(); rs = eng.generate_batch(g, max_new_tokens=96, method=ARMS[i][0]); dt = time.perf_counter() - t
        tot[i][0] += dt; tot[i][1] += sum(len(r.token_ids) for r in rs)
        tot[i][2] += sum(1 for r in rs for rec in r.stats.records if rec.lookup)
setup(NOW)
base = tot[0][1] / tot[0][0]
print(f"batch {B}, {len(ps)} prompts ({','.join(sets)})")
for i, (w, ntok, lk) in tot.items():
    print(f"  {ARMS[i][0]:15s} SKIP_MAX={ARMS[i][1][0]:2d} PLAIN_REPLAN={ARMS[i][1][1]} {ntok / w:6.1f} tok/s ({ntok / w / base:.3f}x), lookup request-rounds {lk}")
