"""heterospec (plain mode) vs autoregressive at batch B, interleaved passes; per-step host time."""
import sys, time, torch, statistics as S
from heterospec.engine import Engine
from heterospec.bench import load_prompt_sets
torch.set_num_threads(2)
e = Engine.from_pretrained()
sets = load_prompt_sets(["mtbench", "alpaca"], 16)
prompts = [p.text for ps in sets.values() for p in ps]
e.generate_batch(prompts[:2], max_new_tokens=8)
e.generate_batch(prompts[:2], max_new_tokens=8, method="autoregressive")
for B in [int(x) for x in sys.argv[1].split(",")]:
    r = {"hs": [], "ar": []}
    info = None
    for rep in range(int(sys.argv[2])):
        for m in (("hs", "ar") if rep % 2 == 0 else ("ar", "hs")):
            t0 = time.perf_counter()
            res = e.generate_batch(prompts[:B], max_new_tokens=96, method="heterospec" if m == "hs" else "autoregressive", lookup=False)
            dt = time.perf_counter() - t0
            r[m].append(sum(len(x.token_ids) for x in res) / dt)
            if m == "hs":
                recs = res[0].stats.records
                info = (sum(x.plain for x in recs), len(recs), round(res[0].stats.policy_s, 3), round(res[0].stats.prefill_s, 3), round(dt, 3))
    ratios = [a / b for a, b in zip(r["hs"], r["ar"])]
    print(B, "hs/ar", [round(x, 3) for x in ratios], "median", round(S.median(ratios), 3), "ar tok/s", round(S.fmean(r["ar"]), 1), "plain/recs, policy_s, prefill_s, wall", info)
