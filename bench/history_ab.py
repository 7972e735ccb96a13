"""HeteroSpec with and without the output history (chains copied from earlier requests), side by
side in one process (issue 10): two engines on the built-in pair, one with the history
(``Engine.lookup_history``) and one without, plus autoregressive decoding as the reference, taking
turns per prompt over the five sets (the order rotating), so the box's drift is shared.

    python bench/history_ab.py [--n 4] [--max-new-tokens 128] [--dtype float32] [--out DIR]

Each engine keeps its own online state (policy, lookup gate) in memory from a fresh start: delete
the cached online state first (``~/.cache/heterospec/costs/*.online-*``) for a run from nothing.
The history holds every earlier HeteroSpec call's prompts and outputs of its engine, never an
earlier answer to the same prompt (``OutputHistory.same_prompt``), so no method's answer is copied by another.
Prints and writes a table: tokens/s per set, ratios to autoregressive, lookup rounds from the
history, and whether every output equals autoregressive's.
"""
import argparse
import json
import os
import statistics
import time

import torch

import heterospec
from heterospec.bench import load_prompt_sets, machine_description, speed_flags
from heterospec.lookup import OutputHistory

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--sets", nargs="+", default=["mtbench", "humaneval", "gsm", "alpaca", "cnndm"])
ap.add_argument("--n", type=int, default=4, help="prompts per set")
ap.add_argument("--max-new-tokens", type=int, default=128)
ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
ap.add_argument("--out", default="bench/out/history_ab")
args = ap.parse_args()
torch.set_num_threads(2)
flags = speed_flags(announce=True)
dtype = getattr(torch, args.dtype)
sets = load_prompt_sets(args.sets, args.n, 0)
with_h = heterospec.Engine.from_pretrained(device="cpu", dtype=dtype)
with_h.lookup_history = OutputHistory()          # (off by default in the engine)
without = heterospec.Engine.from_pretrained(device="cpu", dtype=dtype)
without.lookup_history = None
systems = {"autoregressive": (with_h, "autoregressive"), "heterospec": (with_h, "heterospec"),
           "heterospec-no-history": (without, "heterospec")}
warm = next(iter(sets.values()))[0].text
for eng, method in systems.values():
    eng.generate(warm, max_new_tokens=8, method=method)
names = list(systems)
rows = {s: {n: [0, 0.0, 0, 0] for n in names} for s in sets}     # tokens, seconds, history rounds, calls
same = {n: 0 for n in names}
total = 0
for s, prompts in sets.items():
    for i, p in enumerate(prompts):
        order = names[i % len(names):] + names[:i % len(names)]
        outs = {}
        for n in order:
            eng, method = systems[n]
            t0 = time.perf_counter()
            r = eng.generate(p.text, max_new_tokens=args.max_new_tokens, method=method)
            dt = time.perf_counter() - t0
            outs[n] = r.token_ids
            row = rows[s][n]
            row[0] += len(r.token_ids)
            row[1] += dt
            row[2] += sum(x.history for x in r.stats.records)
            row[3] += r.stats.target_calls
        total += 1
        for n in names:
            same[n] += outs[n] == outs["autoregressive"]
        print(f"{s} #{i}: " + " ".join(f"{n}={'same' if outs[n] == outs['autoregressive'] else 'DIFF'}"
                                       for n in names[1:]), flush=True)

lines = [f"Machine: {machine_description(with_h.device)}, CPU flags: {' '.join(flags)}; {args.dtype}; "
         f"{args.n} prompts per set x {args.max_new_tokens} tokens, greedy, interleaved per prompt", "",
         "| set | AR tok/s | heterospec / AR | heterospec, no history / AR | with / without history "
         "| history calls (of target calls) |", "|---|---|---|---|---|---|"]
ratios = {"with": [], "without": [], "ab": []}
for s in sets:
    rate = {n: rows[s][n][0] / rows[s][n][1] for n in names}
    w, wo = rate["heterospec"] / rate["autoregressive"], rate["heterospec-no-history"] / rate["autoregressive"]
    ratios["with"].append(w)
    ratios["without"].append(wo)
    ratios["ab"].append(w / wo)
    h = rows[s]["heterospec"]
    lines.append(f"| {s} | {rate['autoregressive']:.1f} | {w:.3f}x | {wo:.3f}x | {w / wo:.3f}x | "
                 f"{h[2]} of {h[3]} |")
lines.append(f"| **mean** | | {statistics.fmean(ratios['with']):.3f}x | {statistics.fmean(ratios['without']):.3f}x "
             f"| {statistics.fmean(ratios['ab']):.3f}x | |")
lines += ["", "Outputs equal to autoregressive's: " + ", ".join(f"{n} {same[n]} / {total}" for n in names)]
text = "\n".join(lines)
print(text)
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, "history_ab.md"), "w") as f:
    f.write(text + "\n")
with open(os.path.join(args.out, "history_ab.json"), "w") as f:
    json.dump({"args": vars(args), "flags": flags, "rows": rows, "same": same, "prompts": total}, f, indent=1)
