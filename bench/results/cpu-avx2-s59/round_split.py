"""Where a heterospec round's time goes, by engine method (wall timers, no profiler)."""
import torch, time, functools, collections, sys
from heterospec import Engine
import heterospec.engine as E
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
eng = Engine.from_pretrained()
sets = sys.argv[1:] or ["humaneval", "cnndm"]
prompts = [p.text for s in sets for p in load_prompts(s, n=3)]
acc = collections.Counter(); cnt = collections.Counter()
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[label] += time.perf_counter() - t; cnt[label] += 1; return r
    setattr(obj, name, g)
d = eng.draft
for n in ("extend", "tree_step", "logits"): wrap(d, n, "draft." + n)
for n in ("_draft_half", "_verify_half", "_draft_steps", "_commit", "_lookup_choice", "_lookup_tree", "_verify", "_decode_one", "_prefill"):
    wrap(eng, n, n)
wrap(eng.target, "forward", "target.forward")
eng.generate(prompts[0], max_new_tokens=16)
pol = eng._policy("heterospec", eng.config, eng.policy)
for n in ("round_plan", "observe", "plan"): wrap(pol, n, "policy." + n)
gate = eng.lookup_gate
if gate is not None:
    for n in ("observe", "observe_plain"): wrap(gate, n, "gate." + n)
acc.clear(); cnt.clear()
tot = 0; rounds = 0; toks = 0; spec = 0
for p in prompts:
    r = eng.generate(p, max_new_tokens=128)
    tot += r.stats.total_s; rounds += r.stats.rounds; toks += r.stats.new_tokens
print("total %.2f s, %d tokens, %d calls-rounds, %.1f tok/s" % (tot, toks, rounds, toks / tot))
for k in sorted(acc, key=lambda k: -acc[k]):
    print("  %-22s %5d calls %8.1f ms total %7.3f ms/call" % (k, cnt[k], 1e3 * acc[k], 1e3 * acc[k] / cnt[k]))
