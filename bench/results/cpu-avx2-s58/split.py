import torch, time, functools, collections
from heterospec import Engine, ops
import heterospec.engine as E
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
eng = Engine.from_pretrained()
prompts = [p.text for p in load_prompts("mtbench", n=4)]
acc = collections.Counter(); cnt = collections.Counter()
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[label] += time.perf_counter() - t; cnt[label] += 1; return r
    setattr(obj, name, g)
d = eng.draft
wrap(d, "extend", "draft.extend"); wrap(d, "tree_step", "draft.tree_step"); wrap(d, "logits", "draft.logits")
wrap(E.ops, "topk_entropy", "topk_entropy")
wrap(eng, "_draft_half", "draft_half"); wrap(eng, "_verify_half", "verify_half")
wrap(eng, "_draft_steps", "_draft_steps")
wrap(eng.target, "forward", "target.forward")
eng.generate(prompts[0], max_new_tokens=16, method="eagle3")
for m in ["eagle3", "heterospec"]:
    acc.clear(); cnt.clear()
    r = eng.generate(prompts[1], max_new_tokens=128, method=m)
    R = max(r.stats.rounds,1)
    print(m, "rounds", r.stats.rounds, "tau %.2f" % r.stats.tau, "total %.3f s" % r.stats.total_s, "verified", r.stats.verified_tokens)
    for k in acc: print("  %-18s %4d calls %7.2f ms/round %6.3f ms/call" % (k, cnt[k], 1e3*acc[k]/R, 1e3*acc[k]/cnt[k]))
