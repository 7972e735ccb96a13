#!/usr/bin/env bash
# Run at bb8270b (since reverted): the quick cost model measured the new way of that commit (each
# timed run right after a run of the same phase) and the old way (a temporary edit of costmodel.py,
# restored after), each from nothing, then batch 1 on 16 MT-bench prompts: heterospec against
# autoregressive. At the shipped code (the old way) the edit finds nothing to change.
set -euo pipefail
cd "$(dirname "$0")/../../.."
run() {
  rm -f ~/.cache/heterospec/costs/cpu-float32-*.json
  python - <<'PY' 2>&1 | grep -v Warn
import collections, time, torch
from heterospec import Engine
from heterospec.bench import bench_call, load_prompt_sets
torch.set_num_threads(2)
eng = Engine.from_pretrained()
pol = eng._policy("heterospec", eng.config, eng.policy)
cm = pol.cost.model if hasattr(pol.cost, "model") else None
prompts = [p.text for ps in load_prompt_sets(["mtbench"], 16, 0).values() for p in ps]
t, kinds = collections.Counter(), collections.Counter()
for i, p in enumerate(prompts):
    for m in (("autoregressive", "heterospec") if i % 2 == 0 else ("heterospec", "autoregressive")):
        s = time.perf_counter(); out = eng.generate_batch([p], max_new_tokens=96, **bench_call(m)); t[m] += time.perf_counter() - s
        if m == "heterospec":
            for r in out[0].stats.records:
                kinds["plain" if r.plain else "lookup" if r.lookup else "speculative"] += 1
print("batch 1, 16 prompts: heterospec / autoregressive %.3f" % (t["autoregressive"] / t["heterospec"]), dict(kinds))
PY
}
for rep in 1 2; do
  echo "== new (shipped)"; run
  cp heterospec/costmodel.py /tmp/costmodel.py.keep
  python - <<'PY'
p = "heterospec/costmodel.py"
s = open(p).read()
s = s.replace("                    jobs[i]()\n                    t0 = now()\n", "                    t0 = now()\n", 1)
open(p, "w").write(s)
PY
  echo "== old"; run || true
  cp /tmp/costmodel.py.keep heterospec/costmodel.py
done
