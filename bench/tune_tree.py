"""Pick a device's tree settings: eagle3 tokens/s over a grid of (top_k, depth, total_tokens),
interleaved with autoregressive decoding in one run, on calibration-split prompts (disjoint from
every benchmark set, so tuning never sees the benchmark).

    python bench/tune_tree.py                       # the CPU grid behind config.CPU_DEFAULT
    python bench/tune_tree.py --grid 4,3,8 6,5,16 --n 8 --max-new-tokens 96 --reps 1
    python bench/tune_tree.py --dtype bfloat16 --grid 4,3,8 4,4,12 6,4,16 --reps 1   # a bf16 target

Prints one line per setting (tokens/s, ratio to autoregressive, tokens per target call, draft and verify time) and
writes the same as JSON with ``--out``. Timings are only comparable within one run.
"""

import argparse
import json
import sys
import time
import warnings

CPU_GRID = ["2,3,4", "3,3,6", "4,3,8", "4,4,8", "4,5,10", "6,4,12", "6,5,16", "8,5,24"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", nargs="+", default=CPU_GRID, help="top_k,depth,total_tokens triples")
    ap.add_argument("--n", type=int, default=6, help="calibration-split prompts")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="target weights (default: the engine's default for the device)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args(argv)

    from tqdm.auto import tqdm

    import heterospec
    from heterospec import SpecConfig
    from heterospec.train.prompts import calibration_prompts

    grid = [tuple(int(v) for v in g.split(",")) for g in args.grid]
    if any(len(g) != 3 for g in grid):
        raise SystemExit(f"--grid wants top_k,depth,total_tokens triples, got {args.grid}")
    warnings.filterwarnings("ignore", message="no entropy_bins.json")
    engine = heterospec.Engine.from_pretrained(device=args.device, dtype=args.dtype)
    prompts = calibration_prompts(args.n, seed=args.seed)[0]
    settings = [("autoregressive", "autoregressive", None)]
    settings += [(g, "eagle3", SpecConfig(top_k=g[0], depth=g[1], total_tokens=g[2])) for g in grid]
    engine.generate(prompts[0], max_new_tokens=8, method="eagle3", config=settings[1][2])  # warm-up
    runs = {key: [] for key, _, _ in settings}
    bar = tqdm(total=args.reps * len(prompts) * len(settings), desc="tune-tree", unit="gen")
    for _ in range(args.reps):
        for p in prompts:
            for key, method, cfg in settings:       # interleaved: every setting sees the same load
                t0 = time.perf_counter()
                s = engine.generate(p, max_new_tokens=args.max_new_tokens, method=method, config=cfg).stats
                runs[key].append((s.new_tokens, time.perf_counter() - t0, s.new_tokens, max(s.target_calls, 1),
                                  s.draft_s, s.verify_s))
                bar.update()
    bar.close()
    rows, ar = [], None
    for key, v in runs.items():
        tokens, secs, calls = sum(x[0] for x in v), sum(x[1] for x in v), sum(x[3] for x in v)
        tps = tokens / secs
        ar = ar or tps
        rows.append({"setting": key, "tokens_per_s": tps, "vs_autoregressive": tps / ar, "tokens_per_call": tokens / calls,
                     "draft_ms_per_round": 1e3 * sum(x[4] for x in v) / calls,
                     "verify_ms_per_call": 1e3 * sum(x[5] for x in v) / calls})
        r = rows[-1]
        print(f"{str(key):16s} {tps:6.2f} tok/s {r['vs_autoregressive']:.2f}x tokens/call {r['tokens_per_call']:.2f} "
              f"draft {r['draft_ms_per_round']:.1f} ms/round verify {r['verify_ms_per_call']:.1f} ms/call")
    best = max(rows[1:], key=lambda r: r["tokens_per_s"])
    print(f"fastest: {best['setting']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
