import torch, time, sys
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
eng = Engine.from_pretrained(dtype=sys.argv[1] if len(sys.argv) > 1 else None)
sets = load_prompt_sets(["mtbench", "humaneval"], 4, 0)
prompts = [p.text for ps in sets.values() for p in ps]
eng.generate(prompts[0], max_new_tokens=16, **bench_call("heterospec"))
for rep in range(2):
    rounds = plain = 0; pol = tot = 0.0
    for p in prompts:
        r = eng.generate(p, max_new_tokens=96, **bench_call("heterospec"))
        s = r.stats; pol += s.policy_s; tot += s.total_s
        rounds += sum(1 for x in s.records if not x.plain); plain += sum(1 for x in s.records if x.plain)
    print("spec rounds", rounds, "plain", plain, "policy_s %.4f of %.3f s (%.2f%%); %.1f us per step" % (pol, tot, 100 * pol / tot, 1e6 * pol / (rounds + plain)))
