import torch, time, sys, statistics
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
eng = Engine.from_pretrained(dtype=sys.argv[2] if len(sys.argv) > 2 else None)
sets = load_prompt_sets(["mtbench"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
B = int(sys.argv[1])
for m in ("autoregressive", "heterospec"):
    eng.generate_batch(prompts[:B], max_new_tokens=4, **bench_call(m))
res = {"autoregressive": [], "heterospec": []}
for rep in range(4):
    for g in range(0, 16, B):
        for m in (("autoregressive", "heterospec") if rep % 2 == 0 else ("heterospec", "autoregressive")):
            r = eng.generate_batch(prompts[g:g + B], max_new_tokens=2, **bench_call(m))
            res[m].append(r[0].stats.prefill_s)
for m, v in res.items():
    print(m, "prefill median %.1f ms mean %.1f (n=%d)" % (1e3 * statistics.median(v), 1e3 * statistics.fmean(v), len(v)))
