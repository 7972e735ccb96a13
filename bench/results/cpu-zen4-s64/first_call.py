import torch, cProfile, pstats, time, glob, os
for f in glob.glob(os.path.expanduser("~/.cache/heterospec/costs/*.online-*")): os.remove(f)
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
eng = Engine.from_pretrained()
sets = load_prompt_sets(["mtbench", "alpaca"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
pr = None
t = time.perf_counter(); r = eng.generate_batch(prompts[:1], max_new_tokens=8, **bench_call("heterospec"))[0]; print("first hs call %.1f ms" % (1e3 * (time.perf_counter() - t)))
pass
print([(round(1e3*x.draft_s,1), round(1e3*x.verify_s,1), x.plain, x.lookup) for x in r.stats.records])

