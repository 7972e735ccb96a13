import torch, time, sys, statistics
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
eng = Engine.from_pretrained(dtype=sys.argv[1] if len(sys.argv) > 1 else None)
sets = load_prompt_sets([sys.argv[2] if len(sys.argv) > 2 else "alpaca"], 4, 0)
prompts = [p for ps in sets.values() for p in ps]
for m in ("autoregressive", "heterospec"):
    eng.generate(prompts[0].text, max_new_tokens=16, **bench_call(m))
for rep in range(2):
    for p in prompts:
        out = []
        for m in (("autoregressive", "heterospec") if rep == 0 else ("heterospec", "autoregressive")):
            r = eng.generate(p.text, max_new_tokens=128, **bench_call(m)); s = r.stats
            if m == "autoregressive":
                steps = [x.verify_s for x in s.records] or [s.verify_s / max(s.target_calls, 1)]
                out.append("AR %3d tok %6.1f ms, step %.2f ms" % (len(r.token_ids), 1e3 * s.total_s, 1e3 * s.verify_s / s.target_calls))
            else:
                pl = [x.verify_s for x in s.records if x.plain]
                out.append("HS %3d tok %6.1f ms, plain %3d med %.2f mean %.2f first3 %s; spec %d lookup %d" % (len(r.token_ids), 1e3 * s.total_s, len(pl), 1e3 * statistics.median(pl) if pl else 0, 1e3 * statistics.fmean(pl) if pl else 0, [round(1e3 * x, 1) for x in pl[:3]], sum(1 for x in s.records if not x.plain and not x.lookup), sum(1 for x in s.records if x.lookup)))
        print(p.id, " | ".join(out))
