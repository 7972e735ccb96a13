import time, torch, heterospec, sys
from heterospec.bench import load_prompt_sets
from heterospec import engine as E, lookup as LK, datastore as DS, policy as PO
import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'cpu-zen4-s67'))
from clocks import Timers, forward_clock
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(dtype=getattr(torch, sys.argv[1] if len(sys.argv)>1 else "float32"))
inside = forward_clock(eng)
T = Timers()
for cls, names in [(E.Engine, ["_draft_half", "_verify_half"]), (E.Engine, ["_lookup_choice", "_lookup_proposals", "_lookup_tree", "_verify", "_commit", "_decode_one", "_plain_step", "_emit", "_round_seconds"]),
                   (LK.LookupGate, ["propose", "choose", "observe", "observe_plain", "holds_batch"]),
                   (LK.ContextIndex, ["extend"]),
                   (DS.CorpusIndex, ["propose", "lookup"]),
                   (PO.FittedPolicy, ["plan", "round_plan", "observe"])]:
    for n in names:
        if hasattr(cls, n): T.wrap(cls, n, cls.__name__ + "." + n)
sets = load_prompt_sets(["mtbench", "alpaca"], 8)
ps = [p.text for s in sets.values() for p in s]
eng.generate(ps[0], max_new_tokens=16)
T.clear(); inside[0] = 0.0
t = time.perf_counter(); n = 0; rounds = 0
for p in ps:
    r = eng.generate(p, max_new_tokens=96); n += len(r.token_ids); rounds += len(r.stats.records)
w = time.perf_counter() - t
print(f"{n} tokens, {rounds} rounds, {n/w:.1f} tok/s; host {1e3*(w-inside[0])/rounds:.3f} ms/round")
for k, v in sorted(T.acc.items(), key=lambda kv: -kv[1]):
    print(f"  {k:32s} {1e6*v/rounds:8.1f} us/round  ({T.cnt[k]} calls, {1e6*v/max(T.cnt[k],1):.1f} us/call)")
