"""Per-call prefill time (Engine._prefill) and the rest of generate_batch, autoregressive vs
heterospec, alternated per group (float32). Measurement only."""
import os, sys, time, torch, heterospec, statistics
from heterospec.bench import load_prompt_sets
from heterospec import engine as E
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cpu-zen4-s67"))
from clocks import Timers
torch.set_num_threads(2)
B = int(sys.argv[1]); n = int(sys.argv[2]); toks = int(sys.argv[3]) if len(sys.argv) > 3 else 96
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
pol = eng._policy("heterospec", eng.config, "fitted")
print("needs_draft:", {b: pol.needs_draft(b) for b in (1, 2, 4, 8, 16)})
timers = Timers(); timers.wrap(E.Engine, "_prefill")
ps = [p.text for s in load_prompt_sets(["mtbench", "alpaca"], n // 2).values() for p in s]
groups = [ps[i:i + B] for i in range(0, len(ps), B)]
for m in ("autoregressive", "heterospec"): eng.generate_batch(groups[0], max_new_tokens=8, method=m)
res = {m: [[], []] for m in ("autoregressive", "heterospec")}
for i, g in enumerate(groups * 2):
    for m in (("autoregressive", "heterospec") if i % 2 == 0 else ("heterospec", "autoregressive")):
        timers.clear(); t = time.perf_counter(); eng.generate_batch(g, max_new_tokens=toks, method=m)
        res[m][0].append(timers.acc["_prefill"]); res[m][1].append(time.perf_counter() - t)
for m, (pf, tot) in res.items():
    print(f"{m:15s} prefill median {1e3 * statistics.median(pf):7.1f} ms, sum {sum(pf):.2f} s; call sum {sum(tot):.2f} s")
