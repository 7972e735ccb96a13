# End-to-end A/B of the target's attention: tree_attention (on) vs SDPA + dense mask (off), one
# engine, the switch flipped per prompt in alternating order, three methods, 2 prompts x 5 sets.
import time, torch, collections, statistics, sys
from heterospec import Engine
import heterospec.models.attention as A
from heterospec.bench import load_prompt_sets
torch.set_num_threads(2)
dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float32
eng = Engine.from_pretrained(dtype=dtype)
sets = load_prompt_sets(["mtbench", "humaneval", "gsm", "alpaca", "cnndm"], 2, 0)
ps = [q.text for qs in sets.values() for q in qs]
methods = ["autoregressive", "eagle3", "heterospec"]
for on in (False, True):     # warm-up: the quick cost model, linear tuning and the policy's first rounds
    A.CPU_TREE_ATTENTION = on
    for m in methods: eng.generate("Tell me about the history of the bicycle.", max_new_tokens=48, method=m)
tt = collections.defaultdict(float); nt = collections.defaultdict(int); outs = {}
for i, p in enumerate(ps):
    for on in ((False, True) if i % 2 == 0 else (True, False)):
        A.CPU_TREE_ATTENTION = on
        for m in methods:
            t = time.perf_counter(); r = eng.generate(p, max_new_tokens=96, method=m); dt = time.perf_counter() - t
            tt[(on, m)] += dt; nt[(on, m)] += r.stats.new_tokens; outs[(i, on, m)] = r.token_ids
    print(i, {f"{'op' if k[0] else 'sdpa'}/{k[1]}": round(nt[k] / tt[k], 1) for k in tt}, flush=True)
for on in (False, True):
    for m in methods[1:]:
        same = sum(outs[(i, on, m)] == outs[(i, on, "autoregressive")] for i in range(len(ps)))
        print(f"{'tree_attention' if on else 'sdpa'} {m}: greedy output equal to autoregressive's (same attention) "
              f"on {same} / {len(ps)} prompts")
same = sum(outs[(i, True, "autoregressive")] == outs[(i, False, "autoregressive")] for i in range(len(ps)))
print(f"autoregressive, tree_attention vs sdpa: equal on {same} / {len(ps)} prompts")
for m in methods:
    a, b = nt[(False, m)] / tt[(False, m)], nt[(True, m)] / tt[(True, m)]
    print(f"{m:15s} sdpa {a:6.2f} tok/s  tree_attention {b:6.2f} tok/s  ratio {b / a:.3f}")
for on in (False, True):
    ar = nt[(on, "autoregressive")] / tt[(on, "autoregressive")]
    print(("tree_attention" if on else "sdpa          "), " ".join(f"{m} / AR {nt[(on, m)] / tt[(on, m)] / ar:.3f}" for m in methods[1:]))
