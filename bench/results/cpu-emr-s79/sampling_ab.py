"""Sampled decoding (temperature 0.8, top-p 0.95, seed = prompt index) of 4 MT-bench + 4 gsm prompts x 96
tokens: tokens/s and tokens per target call of each method. Run once per checkout (PYTHONPATH), alternating."""
import sys, time, json, heterospec, torch
from heterospec import datasets
eng = heterospec.Engine.from_pretrained()
prompts = [p.text for n in ('mtbench', 'gsm') for p in datasets.load_prompts(n, n=4)]
out = {}
for m in ('autoregressive', 'eagle3', 'heterospec'):
    toks, secs, calls = 0, 0.0, 0
    for i, p in enumerate(prompts):
        r = eng.generate(p, max_new_tokens=96, method=m, temperature=0.8, top_p=0.95, seed=i)
        toks += r.stats.new_tokens; secs += r.stats.total_s - r.stats.prefill_s; calls += r.stats.target_calls
    out[m] = (toks / secs, toks / calls)
print(sys.argv[1], json.dumps({m: [round(a, 2), round(b, 3)] for m, (a, b) in out.items()}))
