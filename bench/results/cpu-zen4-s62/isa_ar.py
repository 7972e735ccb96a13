"""Autoregressive tokens/s at batch 1 (4 MT-bench + 4 Alpaca prompts x 96 tokens, after a warm-up)
and a one-token forward's parts, in this process's instruction set; run by isa_ar.sh alternately
with and without the AVX2 cap."""
import os, time, torch
from heterospec import Engine
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
eng = Engine.from_pretrained()
prompts = [p.text for s in ("mtbench", "alpaca") for p in load_prompts(s, n=4)]
eng.generate(prompts[0], max_new_tokens=8, method="autoregressive")
toks = secs = 0
for p in prompts:
    r = eng.generate(p, max_new_tokens=96, method="autoregressive")
    toks += r.stats.new_tokens; secs += r.stats.total_s
tgt = eng.target
cache = tgt.new_cache(1, 1024)
with torch.inference_mode():
    tgt.forward(torch.randint(0, 1000, (1, 256)), torch.arange(256)[None], cache, torch.zeros(1, dtype=torch.long))
    best = 1e9
    for _ in range(40):
        t = time.perf_counter(); tgt.forward(torch.randint(0, 1000, (1, 1)), torch.tensor([[256]]), cache, torch.tensor([256])); best = min(best, time.perf_counter() - t)
    h = torch.randn(1, 576)
    lm = 1e9
    for _ in range(40):
        t = time.perf_counter(); tgt.lm_head(h); lm = min(lm, time.perf_counter() - t)
print("%-7s AR %.1f tok/s | one-token forward (ctx 256) %.2f ms, lm_head %.2f ms" % (
    os.environ.get("MKL_ENABLE_INSTRUCTIONS", "native"), toks / secs, best * 1e3, lm * 1e3))
