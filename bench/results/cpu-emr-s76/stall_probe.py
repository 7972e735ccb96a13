"""Stalls per method: wall time between rounds (stream callbacks) of autoregressive and heterospec, one
fresh process, SETS x N prompts x 128 tokens interleaved; a gap above 2.5x its call's median is a stall.
For heterospec, where each stall sits relative to lookup / speculative rounds (records)."""
import json, sys, time, os, statistics as st, torch, heterospec
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
sets, n, out = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
e = heterospec.Engine.from_pretrained()
for m in ("autoregressive", "eagle3", "heterospec"):
    e.generate(load_prompts(sets[0], n=1)[0].text, max_new_tokens=8, method=m)
rows = []
for s in sets:
    for i, p in enumerate(load_prompts(s, n=n)):
        for m in (("autoregressive", "heterospec") if i % 2 == 0 else ("heterospec", "autoregressive")):
            stamps = []
            t0 = time.perf_counter()
            r = e.generate(p.text, max_new_tokens=128, method=m, stream=lambda toks: stamps.append(time.perf_counter()))
            gaps = [b - a for a, b in zip([t0] + stamps, stamps)][1:]          # (the first includes prefill)
            med = st.median(gaps)
            kinds = ["L" if x.lookup else ("P" if x.plain else "S") for x in r.stats.records] if m == "heterospec" else None
            stalls = [(j, round(g * 1e3, 1), kinds[j + 1] if kinds and j + 1 < len(kinds) else None,
                       kinds[j] if kinds and j < len(kinds) else None) for j, g in enumerate(gaps) if g > 2.5 * med]
            rows.append({"set": s, "id": p.id, "method": m, "total_s": r.stats.total_s, "median_ms": med * 1e3,
                         "stall_ms": sum(g - med for g in gaps if g > 2.5 * med) * 1e3, "stalls": stalls,
                         "kinds": "".join(kinds) if kinds else None})
            print(s, p.id, m[:6], "median %.1f ms stall excess %.0f ms (%d)" % (med * 1e3, rows[-1]["stall_ms"], len(stalls)),
                  stalls[:6], flush=True)
json.dump(rows, open(out, "w"))
