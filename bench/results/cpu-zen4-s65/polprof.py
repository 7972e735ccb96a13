import torch, time, sys, cProfile, pstats, io
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
eng = Engine.from_pretrained(dtype=sys.argv[1] if len(sys.argv) > 1 else None)
sets = load_prompt_sets(["mtbench", "humaneval"], 4, 0)
prompts = [p.text for ps in sets.values() for p in ps]
eng.generate(prompts[0], max_new_tokens=16, **bench_call("heterospec"))
pr = cProfile.Profile(); rounds = plain = 0; pol = 0.0; tot = 0.0
for p in prompts:
    pr.enable(); r = eng.generate(p, max_new_tokens=96, **bench_call("heterospec")); pr.disable()
    s = r.stats; pol += s.policy_s; tot += s.total_s
    rounds += sum(1 for x in s.records if not x.plain); plain += sum(1 for x in s.records if x.plain)
print("spec rounds", rounds, "plain", plain, "policy_s %.3f of %.3f s; %.1f us per step" % (pol, tot, 1e6 * pol / (rounds + plain)))
o = io.StringIO(); st = pstats.Stats(pr, stream=o); st.sort_stats("cumulative").print_stats(r"policy|lookup|timing|costmodel", 45); print(o.getvalue()[-12000:])
o = io.StringIO(); st = pstats.Stats(pr, stream=o); st.sort_stats("tottime").print_stats(r"policy|lookup|timing|costmodel", 30); print(o.getvalue()[-8000:])
