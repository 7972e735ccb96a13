"""Host parts of heterospec's plain rounds at batch B (float32): the policy's plan and timing,
the lookup gate, the step's records (function timers; measurement only)."""
import os, sys, time, torch, heterospec
from heterospec.bench import load_prompt_sets
from heterospec import engine as E, lookup, policy
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cpu-zen4-s67"))
from clocks import Timers, forward_clock
torch.set_num_threads(2)
B = int(sys.argv[1]); n = int(sys.argv[2])
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
inside = forward_clock(eng)
t = Timers()
for nm in ["_lookup_choice", "_lookup_proposals", "_decode_one", "_plain_step", "_emit", "_compaction_pays", "_round_seconds", "_prefill"]:
    t.wrap(E.Engine, nm)
t.wrap(E, "_progress")
for nm in ["plan", "observe", "round_plan", "plain_rounds_ahead", "needs_draft", "new_requests", "save_state"]:
    t.wrap(policy.FittedPolicy, nm, "pol." + nm)
for nm in ["observe_plain", "due", "choose", "propose", "save", "load"]:
    t.wrap(lookup.LookupGate, nm, "gate." + nm)
ps = [p.text for s in load_prompt_sets(["mtbench", "alpaca"], n // 2).values() for p in s]
groups = [ps[i:i + B] for i in range(0, len(ps), B)]
eng.generate_batch(groups[0], max_new_tokens=16, method="heterospec")
t.clear(); inside[0] = 0.0
w = time.perf_counter(); calls = 0
for g in groups:
    rs = eng.generate_batch(g, max_new_tokens=96, method="heterospec")
    calls += max(r.stats.target_calls for r in rs)
w = time.perf_counter() - w
print(f"batch {B}: {calls} target calls, host {1e3 * (w - inside[0]) / calls:.3f} ms/call")
for k, v in sorted(t.acc.items(), key=lambda kv: -kv[1]):
    print(f"  {k:22s} {1e6 * v / calls:8.1f} us/call  ({t.cnt[k]} calls, {1e6 * v / max(t.cnt[k], 1):.1f} us each)")
