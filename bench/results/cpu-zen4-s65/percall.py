import torch, time, sys
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call, _fit_seconds
torch.set_num_threads(2)
eng = Engine.from_pretrained(dtype=sys.argv[2] if len(sys.argv) > 2 else None)
sets = load_prompt_sets(["mtbench"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
B = int(sys.argv[1])
for m in ("heterospec", "autoregressive"):
    eng.generate_batch(prompts[:1], max_new_tokens=8, **bench_call(m))
for m in ("heterospec", "autoregressive"):
    eng.generate_batch(prompts[:16], max_new_tokens=96, **bench_call(m))
for Bw in (1, 2, 4):   # what the sweep ran before
    for g in range(0, 4, Bw):
        for m in ("heterospec", "autoregressive"):
            eng.generate_batch(prompts[g:g + Bw], max_new_tokens=32, **bench_call(m))
for rep in range(3):
    for g in range(0, 16, B):
        for m in (("autoregressive", "heterospec") if (rep + g // B) % 2 == 0 else ("heterospec", "autoregressive")):
            f0 = _fit_seconds(eng); t = time.perf_counter()
            r = eng.generate_batch(prompts[g:g + B], max_new_tokens=96, **bench_call(m)); w = time.perf_counter() - t
            s = r[0].stats
            other = s.total_s - s.prefill_s - s.verify_s - s.draft_s - s.policy_s
            print(rep, g, m[:6], "wall %.3f pre %.3f verify %.3f draft %.3f policy %.3f (fit %.3f) other %.3f plain %d/%d" % (w, s.prefill_s, s.verify_s, s.draft_s, s.policy_s, _fit_seconds(eng) - f0, other, sum(x.plain for x in s.records), len(s.records)))
