"""Where a heterospec plain step's time goes against an autoregressive step, batch 1 (sweep prompts)."""
import time, torch, heterospec, sys, functools, collections
from heterospec.bench import load_prompt_sets
from heterospec import lookup, datastore, policy, engine as E
from clocks import Timers, forward_clock
torch.set_num_threads(2)
timers = Timers(); acc, cnt, wrap = timers.acc, timers.cnt, timers.wrap
for n in ["_lookup_choice", "_decode_one", "_plain_step", "_commit", "_verify", "_lookup_tree", "_prefill", "_emit", "_cold_step", "_append_pending"]:
    wrap(E.Engine, n, "engine." + n)
wrap(policy.FittedPolicy, "round_plan", "policy.round_plan")
wrap(policy.FittedPolicy, "observe", "policy.observe")
wrap(policy.FittedPolicy, "plain_rounds_ahead", "policy.plain_rounds_ahead")
wrap(lookup.LookupGate, "observe_plain", "gate.observe_plain")
wrap(lookup.LookupGate, "observe", "gate.observe")
for n in ["propose", "choose", "better", "due", "holds_batch", "answered"]: wrap(lookup.LookupGate, n, "gate." + n)
wrap(lookup.ContextIndex, "propose", "ctx.propose"); wrap(lookup.ContextIndex, "extend", "ctx.extend")
wrap(lookup.OutputHistory, "propose", "hist.propose"); wrap(datastore.CorpusIndex, "propose", "corpus.propose")
wrap(E.Engine, "_lookup_proposals", "engine._lookup_proposals")
eng = heterospec.Engine.from_pretrained(dtype=getattr(torch, sys.argv[1]))
sets = load_prompt_sets(["mtbench", "alpaca"], 8)
ps = [p.text for s in sets.values() for p in s]
for p in ps[:2]:
    for m in ("autoregressive", "heterospec"): eng.generate(p, max_new_tokens=16, method=m)
res = {}
for m in ("autoregressive", "heterospec") * 1:
    pass
tot = collections.Counter(); toks = collections.Counter(); per = {}
for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1):
    for p in ps:
        for m in ("autoregressive", "heterospec"):
            acc_before = dict(acc); cnt_before = dict(cnt)
            t = time.perf_counter(); r = eng.generate(p, max_new_tokens=96, method=m); dt = time.perf_counter() - t
            tot[m] += dt; toks[m] += len(r.token_ids)
            d = per.setdefault(m, collections.defaultdict(float))
            for k, v in acc.items(): d[k] += v - acc_before.get(k, 0.0)
            c = per.setdefault(m + "#n", collections.Counter())
            for k, v in cnt.items(): c[k] += v - cnt_before.get(k, 0)
for m in tot:
    print(f"{m}: {toks[m]} tokens, {1e3*tot[m]/toks[m]:.3f} ms/token, {toks[m]/tot[m]:.1f} tok/s")
    for k, v in sorted(per[m].items(), key=lambda kv: -kv[1]):
        if v: print(f"   {k:28s} {1e6*v/toks[m]:8.1f} us/token {per[m+'#n'][k]:6d} calls {1e6*v/max(per[m+'#n'][k],1):8.1f} us/call")
print("ratio heterospec/AR tok/s:", (toks['heterospec']/tot['heterospec'])/(toks['autoregressive']/tot['autoregressive']))
