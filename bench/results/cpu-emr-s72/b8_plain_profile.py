"""Batch 8 on the built-in pair, heterospec settled on plain rounds: cProfile of three generate_batch calls
(8 MT-bench prompts x 96 tokens) after three warm-up calls, heterospec's own host functions listed."""
import cProfile, pstats, sys, time, torch, heterospec
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
e = heterospec.Engine.from_pretrained()
texts = [p.text for p in load_prompts("mtbench", n=16)]
for _ in range(3):
    e.generate_batch(texts[:8], max_new_tokens=96, method="heterospec")
pr = cProfile.Profile(); pr.enable()
for _ in range(3):
    rs = e.generate_batch(texts[8:16], max_new_tokens=96, method="heterospec")
pr.disable()
st = pstats.Stats(pr); st.sort_stats("cumulative")
st.print_stats(r"policy|lookup|json|save|online|engine.py|timing|costmodel", 40)
