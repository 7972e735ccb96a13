"""The dead-layer stop (``Engine.stop_dead_layers``) on and off, interleaved in one process.

A request stops drafting once every candidate of its last drafted layer scores below its
``budget``-th best candidate (no deeper node could enter its Top-N): the verified trees, and so
the outputs and tau, are the same either way; only draft forwards are saved. This measures
what that is worth on this machine: per method (eagle3, heterospec) and set, tokens/s with the
stop on over off (each prompt run both ways back to back, the order alternating), draft
forwards per round, draft ms per round, and a check that both ways gave the same tokens.

    python bench/dead_layers_ab.py [--sets mtbench humaneval gsm alpaca cnndm] [--n 4]
        [--max-new-tokens 128] [--dtype float32] [--out bench/out/dead-layers]

Writes ``OUT/dead_layers_ab.json`` and ``.md``. Run with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm.auto import tqdm

import heterospec
from heterospec.bench import load_prompt_sets, speed_flags, write_report


def _counting(draft):
    """Wrap ``draft.tree_step`` to count draft forwards (one per call, whole batch)."""
    calls = [0]
    inner = draft.tree_step

    def tree_step(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)
    draft.tree_step = tree_step
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", nargs="+", default=["mtbench", "humaneval", "gsm", "alpaca", "cnndm"])
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--methods", nargs="+", default=["eagle3", "heterospec"])
    ap.add_argument("--out", default="bench/out/dead-layers")
    args = ap.parse_args()
    flags = speed_flags(announce=True)
    eng = heterospec.Engine.from_pretrained(device="cpu", dtype=getattr(torch, args.dtype))
    calls = _counting(eng.draft)
    sets = load_prompt_sets(args.sets, args.n, 0)
    for m in args.methods:                                      # warm-up, untimed
        eng.generate(sets[args.sets[0]][0].text, max_new_tokens=16, method=m)
    rows = {}
    jobs = [(s, p, m) for s in args.sets for p in sets[s] for m in args.methods]
    for i, (s, prompt, m) in enumerate(tqdm(jobs, desc="dead-layer stop A/B", unit="prompt")):
        order = (True, False) if i % 2 == 0 else (False, True)
        got = {}
        for stop in order:
            eng.stop_dead_layers = stop
            calls[0] = 0
            t0 = time.perf_counter()
            out = eng.generate(prompt.text, max_new_tokens=args.max_new_tokens, method=m)
            got[stop] = (out, time.perf_counter() - t0, calls[0])
        r = rows.setdefault((m, s), {"tokens": 0, "s_on": 0.0, "s_off": 0.0, "fw_on": 0, "fw_off": 0, "rounds": 0,
                                     "draft_s_on": 0.0, "draft_s_off": 0.0, "same": True})
        (on, s_on, f_on), (off, s_off, f_off) = got[True], got[False]
        r["tokens"] += len(on.token_ids)
        r["s_on"] += s_on
        r["s_off"] += s_off
        r["fw_on"] += f_on
        r["fw_off"] += f_off
        r["rounds"] += on.stats.rounds
        r["draft_s_on"] += on.stats.draft_s
        r["draft_s_off"] += off.stats.draft_s
        r["same"] &= on.token_ids == off.token_ids
    lines = [f"CPU flags: {' '.join(flags)}; {args.dtype}; {args.n} prompts x {args.max_new_tokens} tokens per set",
             "", "| method | set | tok/s on / off | ratio | draft forwards per round on / off | draft ms per round on / off "
             "| same tokens |", "|---|---|---|---|---|---|---|"]
    for m in args.methods:
        ratios = []
        for s in args.sets:
            r = rows[(m, s)]
            ratio = r["s_off"] / r["s_on"]
            ratios.append(ratio)
            n = max(r["rounds"], 1)
            lines.append(f"| {m} | {s} | {r['tokens'] / r['s_on']:.1f} / {r['tokens'] / r['s_off']:.1f} | {ratio:.3f} "
                         f"| {r['fw_on'] / n:.2f} / {r['fw_off'] / n:.2f} | {1e3 * r['draft_s_on'] / n:.2f} / "
                         f"{1e3 * r['draft_s_off'] / n:.2f} | {r['same']} |")
        lines.append(f"| {m} | **mean** | | **{statistics.mean(ratios):.3f}** | | | |")
    write_report(args.out, "dead_layers_ab", "\n".join(lines),
                 {"flags": flags, "args": vars(args), "rows": {f"{m}/{s}": r for (m, s), r in rows.items()}})


if __name__ == "__main__":
    main()
