import torch, time, sys, collections, functools
from heterospec import Engine, policy as P, lookup as L, engine as E
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
acc = collections.Counter(); cnt = collections.Counter()
def wrap(cls, name, label=None):
    f = getattr(cls, name); label = label or f"{cls.__name__}.{name}"
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[label] += time.perf_counter() - t; cnt[label] += 1
    setattr(cls, name, g)
for n in ("round_plan", "observe", "save_state", "new_requests", "needs_draft", "max_tree_nodes", "plain_rounds_ahead", "fitted_plan"):
    wrap(P.FittedPolicy, n)
wrap(P, "fit_plan")
wrap(L.OutputHistory, "add"); wrap(L.ContextIndex, "__init__"); wrap(L.OutputHistory, "_index")
for n in ("observe_plain", "save", "due"):
    wrap(L.LookupGate, n)
for n in ("_lookup_choice", "_decode_one", "_prefill", "_plain_step", "_cold_step", "_compaction_pays", "_emit"):
    wrap(E.Engine, n)
E.fit_plan = P.fit_plan
eng = Engine.from_pretrained(dtype=sys.argv[3] if len(sys.argv) > 3 else None)
sets = load_prompt_sets(["mtbench"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
B = int(sys.argv[1])
for m in ("autoregressive", "heterospec"):
    eng.generate_batch(prompts[:B], max_new_tokens=16, **bench_call(m))
for m in ("autoregressive", "heterospec"):
    acc.clear(); cnt.clear(); w = 0
    for rep in range(int(sys.argv[2])):
        for g in range(0, 16, B):
            t = time.perf_counter(); eng.generate_batch(prompts[g:g + B], max_new_tokens=96, **bench_call(m)); w += time.perf_counter() - t
    print(m, "wall %.3f" % w)
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]): print("  %-34s %8.1f ms  n=%5d  %7.1f us each" % (k, 1e3 * v, cnt[k], 1e6 * v / cnt[k]))
