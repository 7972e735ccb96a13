"""A/B in one process (issue 10): the fitted policy priced by this device's cost model with the
engine's rounds timed against its curves (``in_use`` factors, `heterospec costs --in-use`) vs the
same curves alone (``in_use`` emptied), against autoregressive. Every (case, pass, batch) starts
from a fresh online state and a fresh lookup gate: what a new process meets.

    heterospec costs --in-use only        # the factors, on this device's saved cost model
    python bench/results/cpu-amx-s49/ab_in_use.py --batches 1 --sets mtbench humaneval gsm alpaca cnndm
    python bench/results/cpu-amx-s49/ab_in_use.py --batches 1 2 4 8 16 --sets mtbench --prompts 16
"""
import argparse, copy, statistics, time, torch, heterospec
from heterospec import costmodel
from heterospec.bench import load_prompt_sets, speed_flags
from heterospec.lookup import LookupGate
from heterospec.policy import FittedPolicy
ap = argparse.ArgumentParser()
ap.add_argument("--batches", type=int, nargs="+", default=[1])
ap.add_argument("--prompts", type=int, default=4, help="prompts per set")
ap.add_argument("--sets", nargs="+", default=["mtbench", "humaneval", "gsm", "alpaca", "cnndm"])
ap.add_argument("--passes", type=int, default=3)
ap.add_argument("--max-new-tokens", type=int, default=96)
ap.add_argument("--dtype", default="float32")
args = ap.parse_args()
torch.set_num_threads(2)
speed_flags(announce=True)

eng = heterospec.Engine.from_pretrained(device="cpu", dtype=getattr(torch, args.dtype))
new_cm = costmodel.CostModel.load(costmodel.cache_path(costmodel.fingerprint(eng)))
assert new_cm.in_use.get("batch_sizes"), "measure the factors first: heterospec costs --in-use only"
old_cm = copy.deepcopy(new_cm)
old_cm.in_use = {}
print("in-use factors (batch: round, plain):",
      ", ".join(f"{b}: {r:.2f}, {p:.2f}" for b, r, p in zip(new_cm.in_use["batch_sizes"], new_cm.in_use["round"], new_cm.in_use["plain"])))
sets = load_prompt_sets(args.sets, args.prompts, 0)
prompts = [p.text for s in args.sets for p in sets[s]]
cases = ["ar", "new", "old"]
kinds = {}


def run(case, B, n, record=False):
    method = "autoregressive" if case == "ar" else "heterospec"
    if case != "ar":                       # a fresh online state and lookup gate, not persisted
        eng.cost_model = new_cm if case == "new" else old_cm
        eng.lookup_gate = LookupGate()
    t0, toks, out = time.perf_counter(), 0, []
    for i in range(0, len(prompts), B):
        res = eng.generate_batch(prompts[i:i + B], max_new_tokens=n, method=method)
        out += [r.token_ids for r in res]
        toks += sum(len(r.token_ids) for r in res)
        if record and case != "ar":
            for r in res:
                for rec in r.stats.records:
                    kind = "lookup" if rec.lookup else "plain" if rec.plain else "spec"
                    k = kinds.setdefault((case, B, kind), [0, 0])
                    k[0] += 1
                    k[1] += rec.accept_len
    return out, toks / (time.perf_counter() - t0)


for c in cases:
    run(c, 1, 8)
rate = {(c, B): [] for c in cases for B in args.batches}
outs = {}
for rep in range(args.passes):
    for B in args.batches:
        for c in (cases if rep % 2 == 0 else cases[::-1]):
            out, r = run(c, B, args.max_new_tokens, record=True)
            rate[c, B].append(r)
            outs.setdefault((c, B), out)
    print(f"pass {rep + 1}/{args.passes} done", flush=True)
for (c, B), out in outs.items():
    assert out == outs["ar", B], f"{c} b{B}: greedy output differs from autoregressive"
print("greedy output identical to autoregressive for new and old at every batch size")
print(f"{'batch':>5} {'ar tok/s':>9} {'new/ar':>7} {'old/ar':>7} {'new/old':>8}   (medians of per-pass ratios)")
for B in args.batches:
    r = lambda c: statistics.median([a / b for a, b in zip(rate[c, B], rate["ar", B])])
    nr = statistics.median([a / b for a, b in zip(rate["new", B], rate["old", B])])
    print(f"{B:>5} {statistics.median(rate['ar', B]):9.1f} {r('new'):7.3f} {r('old'):7.3f} {nr:8.3f}")
print("per pass new/old:", {B: [round(a / b, 3) for a, b in zip(rate["new", B], rate["old", B])] for B in args.batches})
print("request-rounds by kind per pass (mean accepted drafts per round):")
for B in args.batches:
    for c in ("new", "old"):
        print(f"  b{B} {c}: " + ", ".join(f"{kind} {kinds[c, B, kind][0] / args.passes:.0f} ({kinds[c, B, kind][1] / max(kinds[c, B, kind][0], 1):.2f})"
                                         for kind in ("plain", "spec", "lookup") if (c, B, kind) in kinds))
