"""A/B in one process: the built-in target in bfloat16 streaming its Q4_1 / Q8_0 codes (rounded to
bfloat16 in registers; seventy-third session) against the same bfloat16 target streaming 16-bit
weights (the codes withheld at load, as before), with float32 beside them. Autoregressive and
heterospec, greedy, the engines interleaved per prompt; tokens/s and the greedy texts compared."""
import json, statistics, sys, time, torch, heterospec
import heterospec.models.layers as layers
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
keep = layers.keep_block_source
engines = {"float32": heterospec.Engine.from_pretrained(dtype=torch.float32),
           "bf16-codes": heterospec.Engine.from_pretrained(dtype=torch.bfloat16)}
layers.keep_block_source = lambda *a: None          # as before: no codes for bfloat16
engines["bf16-16bit"] = heterospec.Engine.from_pretrained(dtype=torch.bfloat16)
layers.keep_block_source = keep
prompts = [p.text for p in load_prompts("mtbench", n=4)]
methods = ("autoregressive", "heterospec")
for e in engines.values():                          # warm-up (cost models measured here if missing)
    for m in methods:
        e.generate(prompts[0], max_new_tokens=32, method=m)
rate, texts = {}, {}
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for rep in range(reps):
    for i, p in enumerate(prompts):
        for name, e in engines.items():
            for m in methods:
                t0 = time.perf_counter(); r = e.generate(p, max_new_tokens=96, method=m)
                rate.setdefault((name, m), []).append(len(r.token_ids) / (time.perf_counter() - t0))
                texts[(name, m, i)] = r.token_ids
out = {f"{n}/{m}": {"tok_s_mean": statistics.mean(v), "tok_s": [round(x, 1) for x in v]} for (n, m), v in rate.items()}
for n in engines:
    ar = rate[(n, "autoregressive")]
    out[f"{n}/heterospec"]["vs_autoregressive_mean_of_ratios"] = statistics.mean(h / a for h, a in zip(rate[(n, "heterospec")], ar))
ab = [c / o for c, o in zip(rate[("bf16-codes", "autoregressive")], rate[("bf16-16bit", "autoregressive")])]
out["bf16 codes / 16-bit, autoregressive (paired)"] = {"mean": statistics.mean(ab), "min": min(ab), "max": max(ab)}
ab = [c / o for c, o in zip(rate[("bf16-codes", "heterospec")], rate[("bf16-16bit", "heterospec")])]
out["bf16 codes / 16-bit, heterospec (paired)"] = {"mean": statistics.mean(ab), "min": min(ab), "max": max(ab)}
out["greedy equal: bf16 codes vs 16-bit, autoregressive"] = sum(texts[("bf16-codes", "autoregressive", i)] == texts[("bf16-16bit", "autoregressive", i)] for i in range(len(prompts)))
out["greedy equal: heterospec vs autoregressive, each engine"] = {n: sum(texts[(n, "heterospec", i)] == texts[(n, "autoregressive", i)] for i in range(len(prompts))) for n in engines}
print(json.dumps(out, indent=1))
