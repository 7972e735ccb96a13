"""Does a batch call's tail (requests finished, the rest compacted down to one or two) teach the
fitted policy's batch-1 plain-step correction? Fresh online state, calls of B
prompts, then the policy's plain-step records per batch bucket. Measurement only."""
from heterospec.bench import load_prompt_sets
from heterospec import policy
from common import engine
eng = engine(fresh=True)
log = []
obs = policy.FittedPolicy.observe
def observe(self, plan, bins, accepted, seconds=None, *a, **k):
    if not plan.speculate and seconds is not None:
        log.append((k.get("batch_size"), seconds))
    return obs(self, plan, bins, accepted, seconds, *a, **k)
policy.FittedPolicy.observe = observe
import sys
B, n = int(sys.argv[1]), int(sys.argv[2])
ps = [p.text for p in load_prompt_sets(["mtbench"], n)["mtbench"]]
for i in range(0, n, B):
    eng.generate_batch(ps[i:i + B], max_new_tokens=96, method="heterospec")
pol = eng._policy("heterospec", eng.config, "fitted")
for b, v in sorted(pol._plain.items()):
    print(f"bucket {b}: measured/predicted {v[0] / v[1]:.2f} over weight {v[2]:.1f}; used {pol._plain_used.get(b)}")
import statistics
for B in sorted({b for b, _ in log}):
    s = [x for b, x in log if b == B]
    print(f"  active {B}: {len(s)} timed plain steps, median {1e3 * statistics.median(s):.2f} ms")
