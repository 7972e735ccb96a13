"""In-process A/B of settled weights (models.linear.settled_weights): the engine's calls with the
per-epoch weight check (shipped) against a per-forward check (the engine's context swapped for a
null one), alternated call by call; autoregressive and heterospec, batch 1 and 4, float32.
Also the old check_fits (three tensor ops and two host reads) against the new one, timed alone."""
import contextlib, statistics, sys, time
import torch
from heterospec import Engine
from heterospec import engine as E
from heterospec.bench import bench_call, load_prompt_sets
torch.set_num_threads(2)
eng = Engine.from_pretrained()
prompts = [p.text for ps in load_prompt_sets(["mtbench"], 8, 0).values() for p in ps]
settled = E.settled_weights
for m in ("autoregressive", "heterospec"):
    eng.generate_batch(prompts[:1], max_new_tokens=8, **bench_call(m))
res = {}
for B in (1, 4):
    for m in ("autoregressive", "heterospec"):
        t = {"per-epoch": [], "per-forward": []}
        for i in range(12):
            for arm in (("per-epoch", "per-forward") if i % 2 == 0 else ("per-forward", "per-epoch")):
                E.settled_weights = settled if arm == "per-epoch" else contextlib.nullcontext
                g = (i * B) % len(prompts)
                s = time.perf_counter()
                out = eng.generate_batch(prompts[g:g + B], max_new_tokens=64, **bench_call(m))
                t[arm].append((time.perf_counter() - s) / sum(len(r.token_ids) for r in out))
        E.settled_weights = settled
        r = statistics.median([a / b for a, b in zip(t["per-epoch"], t["per-forward"])])
        print(f"batch {B} {m:15s} per-forward {1e3 * statistics.median(t['per-forward']):.3f} ms/token, "
              f"per-epoch {1e3 * statistics.median(t['per-epoch']):.3f} ms/token, paired time ratio {r:.3f}")
