"""Where a drafted round's draft half goes, float32 batch 1 (heterospec without lookup, mtbench)."""
import time, torch, heterospec, sys, functools, collections
from heterospec.bench import load_prompt_sets
from heterospec import engine as E, ops
from heterospec.models import draft as D
from clocks import Timers, forward_clock
torch.set_num_threads(2)
timers = Timers(); acc, cnt, wrap = timers.acc, timers.cnt, timers.wrap
eng = heterospec.Engine.from_pretrained(dtype=getattr(torch, sys.argv[1]))
dcls = type(eng.draft)
for n in ["extend", "logits", "tree_step", "new_tree", "to_target_ids"]:
    wrap(dcls, n, "draft." + n)
for n in ["_draft_half", "_draft_decide", "_draft_deeper", "_draft_steps", "_decide", "_verify_half", "_commit", "_plain_step", "_decode_one"]:
    wrap(E.Engine, n, "engine." + n)
wrap(E, "_topk_entropy_of", "engine._topk_entropy_of")
wrap(E.ops, "topk_entropy", "ops.topk_entropy")
ps = [p.text for p in load_prompt_sets(["mtbench"], 8)["mtbench"]]
method = sys.argv[2] if len(sys.argv) > 2 else "heterospec-nolookup"
kw = dict(method="heterospec", lookup=False) if method == "heterospec-nolookup" else dict(method=method)
eng.generate(ps[0], max_new_tokens=16, **kw)
acc.clear(); cnt.clear()
for p in ps: eng.generate(p, max_new_tokens=96, **kw)
rounds = cnt["engine._draft_half"]
print(f"{method}: {rounds} drafted rounds")
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"  {k:28s} {1e6*v/max(rounds,1):8.1f} us/drafted round  ({cnt[k]} calls, {1e6*v/max(cnt[k],1):.1f} us/call)")
