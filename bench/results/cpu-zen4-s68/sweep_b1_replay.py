"""The sweep's first phase replayed (fresh online state: its warm-up, then batch-1 calls with
autoregressive and heterospec alternating), logging every plain step the fitted policy times at
batch 1 and the batch-1 plain correction after each call. Measurement only."""
import sys, time, statistics
from heterospec.bench import load_prompt_sets, bench_call
from heterospec import policy
from common import engine
n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
eng = engine(fresh=True)
log = []
obs = policy.FittedPolicy.observe
def observe(self, plan, bins, accepted, seconds=None, *a, **k):
    log.append((bool(plan.speculate), k.get("batch_size"), seconds))
    return obs(self, plan, bins, accepted, seconds, *a, **k)
policy.FittedPolicy.observe = observe
ps = [p.text for p in load_prompt_sets(["mtbench", "alpaca"], 32)["mtbench"]]
methods = ["heterospec", "autoregressive"]
for m in methods: eng.generate_batch(ps[:1], max_new_tokens=8, **bench_call(m))
for m in methods: eng.generate_batch(ps[:16], max_new_tokens=96, **bench_call(m))
pol = eng._policy("heterospec", eng.config, "fitted")
print("after warm-up: plain", {b: round(v[0] / v[1], 2) for b, v in pol._plain.items()}, "used", pol._plain_used)
for g in range(n):
    turn = g % 2
    for m in methods[turn:] + methods[:turn]:
        log.clear(); t = time.perf_counter()
        r = eng.generate_batch(ps[g:g + 1], max_new_tokens=96, **bench_call(m))[0]
        w = time.perf_counter() - t
        if m == "heterospec":
            plain = [s for sp, b, s in log if not sp and s is not None]
            spec = [s for sp, b, s in log if sp and s is not None]
            v = pol._plain.get(1)
            print(f"call {g}: {len(r.token_ids)} tok in {w:.2f} s, {len(spec)} timed spec rounds "
                  f"(median {1e3 * statistics.median(spec) if spec else float('nan'):.1f} ms), timed plain "
                  f"{[round(1e3 * s, 1) for s in plain][:12]}; b1 plain ratio {v[0] / v[1] if v else float('nan'):.2f} "
                  f"(w {v[2] if v else 0:.0f}), used {pol._plain_used.get(1)}, plan speculates {pol.plan(1).speculate}", flush=True)
        else:
            print(f"   AR: {len(r.token_ids)} tok in {w:.2f} s")
