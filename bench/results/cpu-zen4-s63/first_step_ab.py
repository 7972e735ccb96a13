"""The guard's plain rate after the five sets (SETS: which; PASSES: batch-1 passes), and batch 1 on 16 MT-bench prompts afterwards
(heterospec against autoregressive, alternated per prompt), from a fresh online state. Run once
with the engine's first plain step after the prefill untimed (shipped) and once with it timed
(the code before; first_step_ab.sh swaps the line): the guard's plain ms per step is the
mechanism, the ratio the effect."""
import collections, os, statistics, sys, time
import torch
from heterospec import Engine
from heterospec.bench import bench_call, load_prompt_sets
torch.set_num_threads(2)
eng = Engine.from_pretrained()
pol = eng._policy("heterospec", eng.config, eng.policy)

def guard(b=1):
    r = pol._realized.get(b)
    plain = 1e3 * r[4] / r[5] if r and r[5] else float("nan")
    spec = (r[0] / r[1] if r and r[1] else float("nan"))
    return f"guard bucket {b}: plain {plain:.2f} ms/step, speculation {spec:.1f} tok/s, plain {1e3 / plain:.1f} tok/s"

SETS = os.environ.get("SETS", "mtbench humaneval gsm alpaca cnndm").split()
for name, ps in load_prompt_sets(SETS, 4, 0).items():
    for p in ps:
        eng.generate(p.text, max_new_tokens=128, **bench_call("heterospec"))
    print(f"after {name:9s}", guard())
prompts = [p.text for ps in load_prompt_sets(["mtbench"], 16, 0).values() for p in ps]
for rep in range(int(os.environ.get("PASSES", "1"))):
  t, kinds = collections.Counter(), collections.Counter()
  for i, p in enumerate(prompts):
    for m in (("autoregressive", "heterospec") if i % 2 == 0 else ("heterospec", "autoregressive")):
        s = time.perf_counter(); out = eng.generate_batch([p], max_new_tokens=96, **bench_call(m)); t[m] += time.perf_counter() - s
        if m == "heterospec":
            for r in out[0].stats.records:
                kinds["plain" if r.plain else "lookup" if r.lookup else "speculative"] += 1
  print("batch 1, 16 prompts: heterospec / autoregressive tokens/s %.3f" % (t["autoregressive"] / t["heterospec"]), dict(kinds))
  print("after batch 1", guard())
