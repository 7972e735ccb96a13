import time, torch, heterospec, sys, functools, collections
from heterospec.datasets import load_prompts
from heterospec import lookup, datastore, policy, engine as E
torch.set_num_threads(2)
acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[label] += time.perf_counter() - t; cnt[label] += 1
    setattr(obj, name, g)
wrap(datastore.CorpusIndex, "propose", "corpus.propose")
wrap(lookup.LookupGate, "better", "gate.better")
wrap(lookup.LookupGate, "choose", "gate.choose")
wrap(lookup.LookupGate, "observe", "gate.observe")
wrap(lookup.ContextIndex, "propose", "ctx.propose")
wrap(lookup.ContextIndex, "extend", "ctx.extend")
wrap(E.Engine, "_lookup_choice", "engine._lookup_choice")
wrap(E.Engine, "_lookup_tree", "engine._lookup_tree")
wrap(policy.FittedPolicy, "round_plan", "policy.round_plan")
wrap(policy.FittedPolicy, "observe", "policy.observe")
eng = heterospec.Engine.from_pretrained(dtype=getattr(torch, sys.argv[1]))
ps = load_prompts(sys.argv[2], n=4)
for p in ps[:2]: eng.generate(p.text, max_new_tokens=16)
acc.clear(); cnt.clear()
steps = 0; tot = 0
for rep in range(2):
    for p in ps:
        t = time.perf_counter(); r = eng.generate(p.text, max_new_tokens=128, corpus=(sys.argv[3] == "1")); tot += time.perf_counter() - t
        steps += len(r.stats.records)
print(f"{steps} rounds, {1e3*tot/steps:.2f} ms/round")
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"  {k:24s} {1e6*v/steps:7.1f} us/round  ({cnt[k]} calls, {1e6*v/max(cnt[k],1):.1f} us/call)")
