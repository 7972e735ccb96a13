"""Per-call cost of heterospec's plain rounds against autoregressive decoding's steps, one process:
the built-in pair (float32), SET's first N prompts x 128 tokens, greedy, autoregressive and heterospec per
prompt in turn (order alternating), after a warm-up call each. Prints per method the wall time per target
call of the decode loop (generate's time less its prefill), the mean verify_s of heterospec's plain records
and of autoregressive's steps, and heterospec's share of plain calls.
Usage: python plain_step_cost.py SET N [PASSES]"""
import json, statistics, sys, time, torch, heterospec
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
s, n = sys.argv[1], int(sys.argv[2])
passes = int(sys.argv[3]) if len(sys.argv) > 3 else 1
e = heterospec.Engine.from_pretrained()
texts = [p.text for p in load_prompts(s, n=n)]
for m in ("autoregressive", "heterospec"):
    e.generate(texts[0], max_new_tokens=32, method=m)
acc = {m: {"wall": 0.0, "calls": 0, "tokens": 0, "verify": 0.0, "plain_verify": [], "spec_calls": 0} for m in ("autoregressive", "heterospec")}
for k in range(passes):
    for i, t in enumerate(texts):
        for m in (("autoregressive", "heterospec") if (i + k) % 2 == 0 else ("heterospec", "autoregressive")):
            t0 = time.perf_counter()
            r = e.generate(t, max_new_tokens=128, method=m)
            dt = time.perf_counter() - t0
            st = r.stats
            a = acc[m]
            a["wall"] += dt - st.prefill_s if hasattr(st, "prefill_s") else dt
            a["calls"] += st.target_calls; a["tokens"] += len(r.token_ids); a["verify"] += st.verify_s
            a["plain_verify"] += [rec.verify_s for rec in st.records if rec.plain]
            a["spec_calls"] += sum(1 for rec in st.records if not rec.plain)
out = {}
for m, a in acc.items():
    out[m] = {"tok/s (decode loop)": round(a["tokens"] / a["wall"], 2), "ms per target call": round(1e3 * a["wall"] / a["calls"], 3),
              "verify ms per call": round(1e3 * a["verify"] / a["calls"], 3), "calls": a["calls"],
              "speculative calls": a["spec_calls"]}
    if a["plain_verify"]:
        out[m]["plain records: mean verify ms"] = round(1e3 * statistics.mean(a["plain_verify"]), 3)
        out[m]["plain records: median verify ms"] = round(1e3 * statistics.median(a["plain_verify"]), 3)
out["heterospec / autoregressive (decode loop tok/s)"] = round(out["heterospec"]["tok/s (decode loop)"] / out["autoregressive"]["tok/s (decode loop)"], 3)
print(json.dumps(out, indent=1))
