"""In-process A/B of the greedy pick: our greedy_tokens op vs torch.max's index, autoregressive and
heterospec, the same prompts, variants alternated per prompt. Usage: greedy_ab.py DTYPE [BATCH] [N]"""
import sys, time, torch, heterospec
from heterospec import engine as E, sampling
from heterospec.bench import load_prompt_sets
torch.set_num_threads(2)
dtype = getattr(torch, sys.argv[1]); B = int(sys.argv[2]) if len(sys.argv) > 2 else 1
n = int(sys.argv[3]) if len(sys.argv) > 3 else 8
eng = heterospec.Engine.from_pretrained(dtype=dtype)
op_pick = sampling.greedy_tokens
def torch_pick(logits):
    return torch.max(logits, dim=-1).indices if logits.device.type == "cpu" else logits.argmax(dim=-1)
PICKS = {"op": op_pick, "torch.max": torch_pick}
ps = [p.text for s in load_prompt_sets(["mtbench", "alpaca"], n).values() for p in s]
groups = [ps[i:i + B] for i in range(0, len(ps), B)]
methods = ("autoregressive", "heterospec")
for m in methods:
    eng.generate_batch(groups[0], max_new_tokens=16, method=m)
tot = {(m, k): [0.0, 0] for m in methods for k in PICKS}
outs = {}
for i, g in enumerate(groups):
    order = list(PICKS) if i % 2 == 0 else list(PICKS)[::-1]
    for m in methods:
        for k in order:
            E.greedy_tokens = PICKS[k]
            t = time.perf_counter(); rs = eng.generate_batch(g, max_new_tokens=96, method=m); dt = time.perf_counter() - t
            tot[(m, k)][0] += dt; tot[(m, k)][1] += sum(len(r.token_ids) for r in rs)
            outs.setdefault(i, []).append([r.token_ids for r in rs])
E.greedy_tokens = op_pick
same = all(all(o == v[0] for o in v) for v in outs.values())
print(f"{sys.argv[1]} batch {B}: same greedy text everywhere: {same}")
for m in methods:
    r = {k: tot[(m, k)][1] / tot[(m, k)][0] for k in PICKS}
    print(f"  {m:15s} op {r['op']:6.1f} tok/s, torch.max {r['torch.max']:6.1f} tok/s: op/torch.max = {r['op']/r['torch.max']:.3f}")
