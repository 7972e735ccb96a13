import torch, heterospec, sys
from heterospec.bench import load_prompt_sets
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
sets = load_prompt_sets(["mtbench", "alpaca"], 8)
ps = [p.text for s in sets.values() for p in s]
m = sys.argv[1] if len(sys.argv) > 1 else "heterospec"
eng.generate(ps[0], max_new_tokens=16, method=m)
import time; t=time.perf_counter(); n=0
for p in ps:
    n += len(eng.generate(p, max_new_tokens=96, method=m).token_ids)
print(m, n/(time.perf_counter()-t), "tok/s")
