import torch, time, sys, cProfile, pstats, io
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
eng = Engine.from_pretrained(dtype=sys.argv[2] if len(sys.argv) > 2 else None)
sets = load_prompt_sets(["mtbench"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
B = int(sys.argv[1]); N = 64
for m in ("autoregressive", "heterospec"):
    eng.generate_batch(prompts[:B], max_new_tokens=16, **bench_call(m))
for m in ("autoregressive", "heterospec"):
    pr = cProfile.Profile(); t = time.perf_counter(); pr.enable()
    res = eng.generate_batch(prompts[:B], max_new_tokens=N, **bench_call(m))
    pr.disable(); w = time.perf_counter() - t
    s = res[0].stats
    print("=====", m, "wall %.3f steps %d verify %.3f policy %.3f draft %.3f prefill %.3f" % (w, s.target_calls, s.verify_s, s.policy_s, s.draft_s, s.prefill_s))
    o = io.StringIO(); pstats.Stats(pr, stream=o).sort_stats("tottime").print_stats(35); print(o.getvalue()[-9000:])
