import torch, time, statistics
from heterospec import Engine
from heterospec.bench import load_prompt_sets
torch.set_num_threads(2)
eng = Engine.from_pretrained()
sets = load_prompt_sets(["mtbench", "alpaca"], 8, 0)
ps = [q.text for qs in sets.values() for q in qs][:16]
eng.generate_batch(ps[:2], max_new_tokens=2, method="heterospec")
res = {}
for rep in range(4):
    for m in (("autoregressive", "heterospec") if rep % 2 == 0 else ("heterospec", "autoregressive")):
        r = eng.generate_batch(ps, max_new_tokens=48, method=m)
        s = r[0].stats
        steps = max(len(x.token_ids) for x in r)
        res.setdefault(m, []).append((s.total_s - s.prefill_s) / steps * 1000)
        print(m, "decode ms/step %.2f" % res[m][-1], "policy_s %.3f" % s.policy_s, flush=True)
a, h = statistics.median(res["autoregressive"]), statistics.median(res["heterospec"])
print("median ms/step AR %.2f HS %.2f ratio %.3f" % (a, h, h / a))
