"""Why bfloat16 batch-2 speculation stopped in a sweep's later repeats (52nd session): the same
two prompts called repeatedly (as batch-sweep does), fresh policy; per call the ratio to
autoregressive, the round kinds, the guard's sums at the end, and each speculative round's time
with the catch-up the policy took off it:
    python bench/results/cpu-amx-s52/b2_bf16_trace.py bfloat16 2 8
"""
import sys, time
import heterospec.policy as HP
from _setup import benchmark_prompts, engine
dtype, B, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = engine(dtype)
prompts = benchmark_prompts()
cfg = eng.config
pol = HP.FittedPolicy(eng.tables_for(cfg.top_k), eng.cost_model, cfg, ragged=eng.ragged_verify)
log = []
orig = HP.FittedPolicy.observe
def observe(self, plan, bins, accepted, seconds=None, drafted=None, extend_tokens=None, progress=None):
    if plan.speculate and seconds is not None:
        c = self._catchup_ms(plan, extend_tokens) if extend_tokens is not None else 0.0
        log.append((round(1e3 * seconds, 1), None if extend_tokens is None else round(extend_tokens, 1), round(c, 1),
                    sum(a + 1 for a in accepted) / max(len(accepted), 1)))
    return orig(self, plan, bins, accepted, seconds, drafted, extend_tokens, progress)
HP.FittedPolicy.observe = observe
eng.generate_batch(prompts[:1], max_new_tokens=8, method="autoregressive")
for i in range(calls):
    ps = prompts[:B]
    t = time.perf_counter(); eng.generate_batch(ps, max_new_tokens=96, method="autoregressive"); ar = time.perf_counter() - t
    log.clear()
    t = time.perf_counter(); res = eng.generate_batch(ps, max_new_tokens=96, method="heterospec", policy=pol); hs = time.perf_counter() - t
    rec = res[0].stats.records
    st = pol._realized.get(pol.bucket(B))
    print(i, "ratio %.3f" % (ar / hs), "s/l/p %d/%d/%d" % (sum(not r.plain and not r.lookup for r in rec), sum(r.lookup for r in rec), sum(r.plain for r in rec)),
          "guard spec %.1f (n %.1f) plain %.1f" % (st[0] / st[1] if st[1] else 0, st[2], st[3] / st[4] if st[4] else 0) if st else None,
          "time_scale %.2f" % pol.time_scale(pol.bucket(B)), "first spec rounds (ms, extend, catch-up ms, tokens/req):", log[:3], flush=True)
