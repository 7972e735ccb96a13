import torch, time, sys, collections
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
eng = Engine.from_pretrained(dtype=sys.argv[4] if len(sys.argv) > 4 else None)
sets = load_prompt_sets(["mtbench"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
B = int(sys.argv[1]); N = int(sys.argv[3]) if len(sys.argv) > 3 else 96
for m in ("autoregressive", "heterospec"):
    eng.generate_batch(prompts[:B], max_new_tokens=16, **bench_call(m))
acc = collections.defaultdict(lambda: collections.Counter())
for rep in range(int(sys.argv[2])):
    for g in range(0, 16, B):
        for m in (("autoregressive", "heterospec") if (rep + g // B) % 2 == 0 else ("heterospec", "autoregressive")):
            t = time.perf_counter(); res = eng.generate_batch(prompts[g:g + B], max_new_tokens=N, **bench_call(m)); w = time.perf_counter() - t
            s = res[0].stats
            a = acc[m]; a["wall"] += w; a["total"] += s.total_s; a["prefill"] += s.prefill_s; a["verify"] += s.verify_s
            a["draft"] += s.draft_s; a["policy"] += s.policy_s; a["steps"] += s.target_calls
for m, a in acc.items():
    other = a["total"] - a["prefill"] - a["verify"] - a["draft"] - a["policy"]
    print(m, " ".join("%s %.3f" % (k, v) for k, v in a.items()), "other %.3f" % other, "per-step verify %.3f ms" % (1e3 * a["verify"] / a["steps"]))
print("ratio AR/HS wall %.4f" % (acc["autoregressive"]["wall"] / acc["heterospec"]["wall"]))
for pol in eng._fitted.values():
    print("fits", pol._fits, "fit_s %.3f" % pol._fit_s, "round_s %.3f" % pol._round_s)
