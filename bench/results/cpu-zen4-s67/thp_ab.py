"""Plain decoding tok/s in this process (run it with and without THP_MEM_ALLOC_ENABLE=1, alternated)."""
import os, sys, time, torch, heterospec
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
dtype = getattr(torch, sys.argv[1]); method = sys.argv[2] if len(sys.argv) > 2 else "autoregressive"
eng = heterospec.Engine.from_pretrained(dtype=dtype)
ps = [p.text for p in load_prompts("mtbench", n=8)]
eng.generate(ps[0], max_new_tokens=16, method=method)
t = time.perf_counter(); n = 0
for p in ps:
    n += len(eng.generate(p, max_new_tokens=96, method=method).token_ids)
dt = time.perf_counter() - t
with open("/proc/self/smaps_rollup") as f:
    huge = [l.strip() for l in f if "AnonHugePages" in l]
print(f"THP={os.environ.get('THP_MEM_ALLOC_ENABLE', '0')} {method} {sys.argv[1]}: {n/dt:.1f} tok/s  {huge}")
