import torch, time, sys
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
eng = Engine.from_pretrained(dtype=sys.argv[1] if len(sys.argv) > 1 else None)
sets = load_prompt_sets(["mtbench"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
first = sys.argv[2]
other = "heterospec" if first == "autoregressive" else "autoregressive"
eng.generate_batch(prompts[:1], max_new_tokens=8, **bench_call("heterospec"))
eng.generate_batch(prompts[:1], max_new_tokens=8, **bench_call("autoregressive"))
for m in (first, other, other, first):
    t = time.perf_counter(); r = eng.generate_batch(prompts[:16], max_new_tokens=96, **bench_call(m)); w = time.perf_counter() - t
    s = r[0].stats
    print(m[:6], "wall %.3f prefill %.3f verify %.3f" % (w, s.prefill_s, s.verify_s))
