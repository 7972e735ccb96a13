"""Per-forward times of the target at batch B: autoregressive vs heterospec without lookups
(lookup=False), alternated per group; prefill and one-token steps apart. Measurement only."""
import sys, time, statistics
from heterospec.bench import load_prompt_sets
from common import engine, log_forwards
B = int(sys.argv[1]); n = int(sys.argv[2])
eng = engine()
log = []
log_forwards(eng, log)
ps = [p.text for s in load_prompt_sets(["mtbench", "alpaca"], n // 2).values() for p in s]
groups = [ps[i:i + B] for i in range(0, len(ps), B)]
ARMS = [dict(method="autoregressive"), dict(method="heterospec", lookup=False)]
for a in ARMS: eng.generate_batch(groups[0], max_new_tokens=8, **a)
res = {i: {"pre": [], "step": [], "wall": 0.0, "steps_s": 0.0} for i in range(len(ARMS))}
for gi, grp in enumerate(groups):
    for j in range(len(ARMS)):
        i = (gi + j) % len(ARMS)
        log.clear(); t = time.perf_counter(); eng.generate_batch(grp, max_new_tokens=96, **ARMS[i]); w = time.perf_counter() - t
        r = res[i]; r["wall"] += w
        r["pre"] += [s for T, s in log if T > 1]; r["step"] += [s for T, s in log if T == 1]
for i, r in res.items():
    st = r["step"]
    print(f"{ARMS[i]}: wall {r['wall']:.2f} s; prefill sum {sum(r['pre']):.2f} s; steps {len(st)}: "
          f"median {1e3 * statistics.median(st):.2f} ms, mean {1e3 * statistics.mean(st):.2f} ms, "
          f"p10 {1e3 * sorted(st)[len(st) // 10]:.2f}, p90 {1e3 * sorted(st)[9 * len(st) // 10]:.2f}; "
          f"outside forwards {r['wall'] - sum(r['pre']) - sum(st):.2f} s")
