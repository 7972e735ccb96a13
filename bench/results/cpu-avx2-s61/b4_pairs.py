"""The 4-prompt batch of the sweep rerun alternately (this session's check of the b4 spread)."""
import torch, time, sys
from heterospec import Engine
from heterospec.bench import bench_call, load_prompt_sets
torch.set_num_threads(2)
eng = Engine.from_pretrained()
B = int(sys.argv[1]) if len(sys.argv) > 1 else 4
sets = load_prompt_sets(["mtbench"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps][:B]
for m in ("autoregressive", "heterospec"):
    eng.generate_batch(prompts[:1], max_new_tokens=8, **bench_call(m))
for rep in range(4):
    for m in (("autoregressive", "heterospec") if rep % 2 == 0 else ("heterospec", "autoregressive")):
        t = time.perf_counter(); r = eng.generate_batch(prompts, max_new_tokens=96, **bench_call(m)); dt = time.perf_counter() - t
        st = r[0].stats if isinstance(r, list) else r.stats
        print(rep, m[:6], "%.3f s" % dt, getattr(st, "plain_rounds", None), getattr(st, "lookup_rounds", None))
