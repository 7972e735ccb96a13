"""The fitted policy's option shortlist (``FittedPolicy.SHORTLIST`` / ``FULL_EVERY``) on and off,
interleaved in one process.

A fit searches every binning option of the tables (16 for the shipped draft). With the shortlist,
a bucket refits only the options that fitted best in its last full fit, and searches them all
every ``FULL_EVERY``-th fit. Off means every fit is a full one (``FULL_EVERY = 1``). Both arms
share one engine and one policy (its online corrections learn from both); each prompt runs both
ways back to back, the order alternating. Reported per arm: the policy's host time per round
(planning and learning), fits per round, ms per fit, and tokens/s.

    python bench/policy_fit_ab.py [--sets mtbench gsm] [--n 4] [--max-new-tokens 128]
        [--dtype bfloat16] [--out bench/out/policy-fit]

Writes ``OUT/policy_fit_ab.md`` and ``.json``. Run with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm.auto import tqdm

import heterospec
from heterospec.bench import load_prompt_sets, speed_flags, write_report
from heterospec.policy import FittedPolicy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", nargs="+", default=["mtbench", "gsm"])
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="bench/out/policy-fit")
    args = ap.parse_args()
    flags = speed_flags(announce=True)
    eng = heterospec.Engine.from_pretrained(device="cpu", dtype=getattr(torch, args.dtype))
    sets = load_prompt_sets(args.sets, args.n, 0)
    eng.generate(sets[args.sets[0]][0].text, max_new_tokens=16, method="heterospec")   # warm-up
    pols = [p for p in eng._fitted.values() if isinstance(p, FittedPolicy)]
    if not pols:
        raise SystemExit("the engine has no fitted policy (no acceptance tables for its draft)")
    pol = pols[0]
    arms = {"shortlist": FittedPolicy.FULL_EVERY, "full": 1}
    tot = {a: {"tokens": 0, "s": 0.0, "policy_s": 0.0, "rounds": 0, "fits": 0, "fit_s": 0.0} for a in arms}
    jobs = [p for s in args.sets for p in sets[s]]
    for i, prompt in enumerate(tqdm(jobs, desc="policy fit A/B", unit="prompt")):
        for arm in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
            pol.FULL_EVERY = arms[arm]
            fits, fit_s = pol._fits, pol._fit_s
            t0 = time.perf_counter()
            out = eng.generate(prompt.text, max_new_tokens=args.max_new_tokens, method="heterospec")
            t = tot[arm]
            t["s"] += time.perf_counter() - t0
            t["tokens"] += len(out.token_ids)
            t["policy_s"] += out.stats.policy_s
            t["rounds"] += out.stats.target_calls
            t["fits"] += pol._fits - fits
            t["fit_s"] += pol._fit_s - fit_s
    del pol.FULL_EVERY
    lines = [f"CPU flags: {' '.join(flags)}; {args.dtype}; sets {' '.join(args.sets)}, {args.n} prompts x "
             f"{args.max_new_tokens} tokens each", "",
             "| arm | tok/s | policy ms per target call | fits per call | ms per fit |", "|---|---|---|---|---|"]
    for arm, t in tot.items():
        n = max(t["rounds"], 1)
        lines.append(f"| {arm} | {t['tokens'] / t['s']:.2f} | {1e3 * t['policy_s'] / n:.3f} | {t['fits'] / n:.3f} | "
                     f"{1e3 * t['fit_s'] / max(t['fits'], 1):.2f} |")
    lines.append(f"\ntok/s shortlist / full: {tot['shortlist']['tokens'] / tot['shortlist']['s'] / (tot['full']['tokens'] / tot['full']['s']):.3f}")
    write_report(args.out, "policy_fit_ab", "\n".join(lines), {"flags": flags, "args": vars(args), "arms": tot})


if __name__ == "__main__":
    main()
