import statistics, time, sys, torch
import heterospec
from heterospec.config import SpecConfig
from heterospec.bench import load_prompt_sets, speed_flags
torch.set_num_threads(2)
speed_flags(announce=True)
eng = heterospec.Engine.from_pretrained(device="cpu", dtype=torch.float32)
sets = load_prompt_sets(["mtbench", "alpaca", "humaneval"], 2, 0)
prompts = [p.text for s in sets.values() for p in s]
cases = [("ar", dict(method="autoregressive")), ("hs", dict(method="heterospec")),
         ("k1", dict(method="eagle3", config=SpecConfig(top_k=1, depth=0, total_tokens=2))),
         ("k2", dict(method="eagle3", config=SpecConfig(top_k=1, depth=1, total_tokens=3)))]
for n, kw in cases: eng.generate(prompts[0], max_new_tokens=8, **kw)
res = {n: [] for n, _ in cases}; tau = {n: [] for n, _ in cases}; ref = {}; bad = 0
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for name, kw in (cases if rep % 2 == 0 else cases[::-1]):
        tok = 0; t0 = time.perf_counter(); ta = []
        for i, p in enumerate(prompts):
            o = eng.generate(p, max_new_tokens=96, **kw)
            tok += len(o.token_ids); ta.append(o.stats.tau)
            if name == "ar": ref[i] = o.token_ids
            elif i in ref and ref[i] != o.token_ids: bad += 1
        res[name].append(tok / (time.perf_counter() - t0)); tau[name].append(statistics.mean(ta))
for n, v in res.items():
    print(f"{n:4s} tok/s", [round(x, 1) for x in v], "ratio", round(statistics.median([a / b for a, b in zip(v, res["ar"])]), 3), "tau", [round(x, 2) for x in tau[n]])
print("mismatches", bad)
