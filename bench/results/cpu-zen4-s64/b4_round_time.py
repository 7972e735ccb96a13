import torch, time, sys, collections, glob, os
for f in glob.glob(os.path.expanduser("~/.cache/heterospec/costs/*.online-*")): os.remove(f)
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
eng = Engine.from_pretrained()
sets = load_prompt_sets(["mtbench"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
B = int(sys.argv[1])
tot = collections.Counter(); spec = []
for rep in range(int(sys.argv[2])):
    for g in range(0, 16, B):
        for m in (("autoregressive", "heterospec") if (rep + g // B) % 2 == 0 else ("heterospec", "autoregressive")):
            t = time.perf_counter(); res = eng.generate_batch(prompts[g:g + B], max_new_tokens=96, **bench_call(m)); tot[m] += time.perf_counter() - t
            if m == "heterospec":
                spec += [(round(1e3 * r.draft_s, 1), round(1e3 * r.verify_s, 1), r.accept_len) for r in res[0].stats.records if not r.plain and not r.lookup]
pol = list(eng._fitted.values())[0]
print("B", B, {m: round(v, 3) for m, v in tot.items()}, "AR/HS %.4f" % (tot["autoregressive"] / tot["heterospec"]))
print("time sums", {b: [round(x, 1) for x in v] for b, v in pol._time.items()}, "time_used", pol._time_used)
print("time_scale(1) %.2f time_scale(4) %.2f plain_scale(4) %.2f" % (pol.time_scale(1), pol.time_scale(4), pol.plain_scale(4)))
print("spec rounds (draft ms, verify ms, accepted) of request 0:", spec[:40])
