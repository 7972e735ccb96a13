"""What the fitted policy's timed plain steps cost at batch 1 (float32 heterospec, fresh online
state): each observed plain step's seconds beside the target forward inside it, and how many
rounds after the last speculative round it ran. Measurement only."""
import sys, statistics
from heterospec.bench import load_prompt_sets
from heterospec import policy
from common import engine, log_forwards
n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
eng = engine(fresh=True)
events = []
log_forwards(eng, events, "fwd")
obs = policy.FittedPolicy.observe
def observe(self, plan, bins, accepted, seconds=None, *a, **k):
    events.append(("obs", bool(plan.speculate), seconds))
    return obs(self, plan, bins, accepted, seconds, *a, **k)
policy.FittedPolicy.observe = observe
ps = [p.text for p in load_prompt_sets(["mtbench"], n)["mtbench"]]
for p in ps:
    eng.generate(p, max_new_tokens=96, method="heterospec")
since, last_fwd, rows = 99, None, []
for e in events:
    if e[0] == "fwd":
        last_fwd = e
    elif e[1]:
        since = 0
    else:
        since += 1
        if e[2] is not None:
            rows.append((since, e[2], last_fwd[2] if last_fwd else float("nan")))
by = {}
for s, sec, fw in rows:
    by.setdefault(min(s, 6), []).append((sec, fw))
print(f"timed plain steps: {len(rows)}; spec rounds: {sum(1 for e in events if e[0] == 'obs' and e[1])}")
for s in sorted(by):
    v = by[s]
    print(f"  {s} step(s) after a speculative round (6 = 6+): n={len(v)}, timed {1e3 * statistics.median(x for x, _ in v):.2f} ms, "
          f"its forward {1e3 * statistics.median(y for _, y in v):.2f} ms (medians)")
steady = [e[2] for e in events if e[0] == "fwd" and e[1] == 1]
print(f"all one-token forwards: median {1e3 * statistics.median(steady):.2f} ms")
