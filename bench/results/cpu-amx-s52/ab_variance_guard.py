"""A/B of the guard's margin (52nd session; run before FittedPolicy.GUARD_Z shipped, as this
subclass): a guard that holds a bucket plain only where speculation loses by more than Z standard
errors of its measured rate, against the guard without a margin (GUARD_Z 0 since it shipped),
each with its own engine and fresh policy, interleaved with autoregressive;
the same B prompts every call (as batch-sweep) or new ones per call (`new`):
    python bench/results/cpu-amx-s52/ab_variance_guard.py bfloat16 2 8 same
"""
import sys, time, math, statistics
import heterospec.policy as HP
from _setup import benchmark_prompts, engine
dtype, B, calls, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]


class VarianceGuard(HP.FittedPolicy):
    Z = 1.0

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._sq = {}

    def observe(self, plan, bins, accepted, seconds=None, drafted=None, extend_tokens=None, progress=None):
        exp = plan.expected or {}
        if plan.speculate and seconds and bins and "batch_size" in exp:
            b = self.bucket(int(exp["batch_size"]))
            t = float(progress) if progress is not None else sum(a + 1.0 for a in accepted) / len(accepted)
            sq = self._sq.setdefault(b, [0.0, 0.0])
            sq[0], sq[1] = sq[0] * self.REALIZED_FORGET + t * t, sq[1] * self.REALIZED_FORGET + 1.0
        super().observe(plan, bins, accepted, seconds, drafted, extend_tokens, progress)

    def realized_loses(self, bucket):
        r = self._own_or_below(bucket, self.realized)
        if r is None:
            return False
        st, sq = self._realized.get(bucket), self._sq.get(bucket)
        se = 0.0
        if st is not None and sq is not None and st[2] > 0 and sq[1] > 0 and st[1] > 0:
            mean = st[0] / st[2]
            var = max(sq[0] / sq[1] - mean * mean, 0.0)
            se = math.sqrt(var / st[2]) / (st[1] / st[2])
        return r[0] + self.Z * se < r[1]


engs = {k: engine(dtype) for k in ("shipped", "variance")}
pols = {}
for k, e in engs.items():
    cls = VarianceGuard if k == "variance" else HP.FittedPolicy
    pols[k] = cls(e.tables_for(e.config.top_k), e.cost_model, e.config, ragged=e.ragged_verify)
pols["shipped"].GUARD_Z = 0.0          # the guard as it was when this A/B ran
prompts = benchmark_prompts()
for e in engs.values():
    e.generate_batch(prompts[:1], max_new_tokens=8, method="autoregressive")
runs = {"ar": lambda ps: engs["shipped"].generate_batch(ps, max_new_tokens=96, method="autoregressive"),
        "shipped": lambda ps: engs["shipped"].generate_batch(ps, max_new_tokens=96, method="heterospec", policy=pols["shipped"]),
        "variance": lambda ps: engs["variance"].generate_batch(ps, max_new_tokens=96, method="heterospec", policy=pols["variance"])}
walls = {k: [] for k in runs}
for i in range(calls):
    ps = prompts[:B] if mode == "same" else [prompts[(i * B + j) % len(prompts)] for j in range(B)]
    kinds = {}
    for k in list(runs)[i % 3:] + list(runs)[:i % 3]:
        t = time.perf_counter(); res = runs[k](ps); walls[k].append(time.perf_counter() - t)
        if k != "ar":
            rec = [r for x in res for r in x.stats.records]
            kinds[k] = "s%d/l%d/p%d" % (sum(not r.plain and not r.lookup for r in rec), sum(r.lookup for r in rec), sum(r.plain for r in rec))
    print(i, {k: round(walls["ar"][-1] / v[-1], 3) for k, v in walls.items() if k != "ar"}, kinds, flush=True)
for k in ("shipped", "variance"):
    print("ar / %s: median %.3f" % (k, statistics.median(a / b for a, b in zip(walls["ar"], walls[k]))))
