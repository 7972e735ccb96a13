"""Host time per round outside the models' forwards at batch B: autoregressive vs heterospec,
interleaved per group of prompts, with the heterospec round's Python parts (float32)."""
import time, torch, heterospec, sys, functools, collections
from heterospec.bench import load_prompt_sets
from heterospec import engine as E, lookup, policy
from clocks import Timers, forward_clock
torch.set_num_threads(2)
B = int(sys.argv[1]); n = int(sys.argv[2]) if len(sys.argv) > 2 else 16
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
inside = forward_clock(eng)
timers = Timers(); acc, cnt, wrap = timers.acc, timers.cnt, timers.wrap
for nm in ["_lookup_choice", "_decode_one", "_compaction_pays", "_emit", "_plain_step"]: wrap(E.Engine, nm, nm)
wrap(policy.FittedPolicy, "round_plan", "round_plan"); wrap(policy.FittedPolicy, "observe", "observe")
wrap(policy.FittedPolicy, "plain_rounds_ahead", "plain_rounds_ahead")
wrap(lookup.LookupGate, "observe_plain", "observe_plain")
ps = [p.text for s in load_prompt_sets(["mtbench", "alpaca"], n // 2).values() for p in s]
groups = [ps[i:i + B] for i in range(0, len(ps), B)]
for m in ("autoregressive", "heterospec"): eng.generate_batch(groups[0], max_new_tokens=16, method=m)
tot = {m: [0.0, 0.0, 0, 0] for m in ("autoregressive", "heterospec")}
for i, g in enumerate(groups):
    for m in (("autoregressive", "heterospec") if i % 2 == 0 else ("heterospec", "autoregressive")):
        inside[0] = 0.0
        if m == "heterospec": acc_before = dict(acc)
        t = time.perf_counter(); rs = eng.generate_batch(g, max_new_tokens=96, method=m); dt = time.perf_counter() - t
        T = tot[m]; T[0] += dt; T[1] += inside[0]; T[2] += sum(len(r.token_ids) for r in rs)
        T[3] += len(rs[0].stats.records) if m == "heterospec" else max(len(r.token_ids) for r in rs)
for m, (w, f, ntok, rounds) in tot.items():
    print(f"batch {B} {m:15s} {ntok/w:6.1f} tok/s  host {1e3*(w-f)/rounds:.3f} ms/round ({rounds} rounds), forwards {1e3*f/rounds:.2f} ms/round")
hs_rounds = tot["heterospec"][3]
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"   {k:22s} {1e6*v/hs_rounds:8.1f} us/round(hs)  {cnt[k]} calls")
