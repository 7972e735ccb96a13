"""Where heterospec's plain rounds spend time beside autoregressive decoding's steps, one process:
the built-in pair (float32 unless argv[2]), N gsm + MT-bench prompts x 96 tokens, greedy,
autoregressive and heterospec per prompt in turn (order alternating), after one warm-up call each.
cProfile over the timed calls: per decode step, the cumulative ms of the engine's entry points.
Run it on a fresh HETEROSPEC_CACHE (no learned state) to see a cold policy's plain rounds.
Usage: python plain_rounds_profile.py N [DTYPE]"""
import cProfile, json, pstats, sys, time, torch, heterospec
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
n = int(sys.argv[1])
e = heterospec.Engine.from_pretrained(dtype=getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float32"))
texts = [p.text for s in ("gsm", "mtbench") for p in load_prompts(s, n=n)]
for m in ("autoregressive", "heterospec"):
    e.generate(texts[0], max_new_tokens=32, method=m)
want = ("generate_batch", "_prefill", "_decode_one", "_plain_step", "round_plan", "_lookup_choice", "_emit",
        "forward", "observe", "observe_plain", "save_state", "_draft_half", "_verify_half")
res = {}
for m in ("autoregressive", "heterospec"):
    res[m] = {"s": 0.0, "tokens": 0, "rounds": 0, "plain": 0, "prof": cProfile.Profile()}
for i, t in enumerate(texts):
    for m in (("autoregressive", "heterospec") if i % 2 == 0 else ("heterospec", "autoregressive")):
        r = res[m]
        r["prof"].enable(); t0 = time.perf_counter()
        out = e.generate(t, max_new_tokens=96, method=m)
        r["s"] += time.perf_counter() - t0; r["prof"].disable()
        r["tokens"] += len(out.token_ids); r["rounds"] += out.stats.target_calls
        r["plain"] += sum(1 for rec in out.stats.records if rec.plain)
report = {}
for m, r in res.items():
    st = pstats.Stats(r["prof"]).stats
    cum = {}
    for (f, line, name), v in st.items():
        if name in want and "heterospec" in f:
            key = f"{f.split('/')[-1]}:{name}"
            cum[key] = cum.get(key, 0) + v[3]
    report[m] = {"tok/s": r["tokens"] / r["s"], "target calls": r["rounds"], "plain records": r["plain"],
                 "ms per target call": {k: round(1e3 * v / r["rounds"], 3) for k, v in sorted(cum.items())}}
report["heterospec / autoregressive"] = report["heterospec"]["tok/s"] / report["autoregressive"]["tok/s"]
print(json.dumps(report, indent=1))
