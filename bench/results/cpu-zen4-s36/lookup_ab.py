import sys, time, torch, statistics as S
from heterospec.engine import Engine
from heterospec.bench import load_prompt_sets
torch.set_num_threads(2)
e = Engine.from_pretrained()
sets = load_prompt_sets(["mtbench", "alpaca"], 16)
prompts = [p.text for ps in sets.values() for p in ps]
e.generate_batch(prompts[:2], max_new_tokens=8)
for B in [int(x) for x in sys.argv[1].split(",")]:
    r = {True: [], False: []}
    for rep in range(int(sys.argv[2])):
        for lk in ((True, False) if rep % 2 == 0 else (False, True)):
            t0 = time.perf_counter()
            res = e.generate_batch(prompts[:B], max_new_tokens=96, lookup=lk)
            r[lk].append(sum(len(x.token_ids) for x in res) / (time.perf_counter() - t0))
    ratios = [a / b for a, b in zip(r[True], r[False])]
    print(B, "lookup/nolookup", [round(x, 3) for x in ratios], "median", round(S.median(ratios), 3), "tok/s", round(S.fmean(r[False]), 1))
