import torch, time, os, collections, statistics
os.environ["HETEROSPEC_CACHE_RO"] = "1"
from heterospec import Engine
from heterospec.datasets import load_prompts
from heterospec.policy import FittedPolicy
torch.set_num_threads(2)
eng = Engine.from_pretrained()
prompts = [p.text for s in ("alpaca", "humaneval") for p in load_prompts(s, n=3)]
rows = []
real = FittedPolicy.observe
def observe(self, plan, bins, accepted, seconds=None, drafted=None, extend_tokens=None, progress=None, batch_size=None):
    if plan.speculate and seconds is not None:
        e = plan.expected["speculative"]
        ts = plan.expected.get("time_scale", 1.0)
        rows.append((1e3 * seconds, e["ms"] / ts, e.get("draft_ms"), e.get("verify_ms"), extend_tokens, sum(accepted) / max(len(accepted), 1)))
    return real(self, plan, bins, accepted, seconds, drafted, extend_tokens, progress, batch_size)
FittedPolicy.observe = observe
# timing hooks
t = collections.Counter()
def wrap(obj, name):
    f = getattr(obj, name)
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); t[name] += time.perf_counter() - t0; t[name + "#"] += 1; return r
    setattr(obj, name, g)
for n in ("_draft_half", "_verify_half", "_commit"): wrap(eng, n)
for p in prompts:
    r = eng.generate(p, max_new_tokens=128, method="heterospec", policy="fitted")
    print("tau %.2f rounds %d tok/s %.1f" % (r.stats.tau, r.stats.rounds, r.stats.tokens_per_s), flush=True)
print(len(rows), "speculative rounds observed")
if rows:
    for i in range(0, len(rows), max(1, len(rows)//15)):
        print(" obs %.1f pred %.1f (draft %.1f verify %.1f) ext %s acc %.2f" % rows[i])
    print("mean obs %.1f pred %.1f" % (statistics.mean(r[0] for r in rows), statistics.mean(r[1] for r in rows)))
for n in ("_draft_half", "_verify_half", "_commit"):
    if t[n + "#"]: print(n, "%.2f ms" % (1e3 * t[n] / t[n + "#"]))
print(eng._policy("heterospec", eng.config).plan(1).expected)
