"""CPU linear layers: stock F.linear vs the tuned paths (models/linear.py), side by side.

    python bench/cpu_linear.py [--sizes 1 2 4 8 16 32] [--batch-sizes 1 2 4 8 16] [--rounds 3]
                               [--modes stock tuned-onednn tuned]

One engine (the built-in pair, float32); the modes (``stock``: F.linear everywhere;
``tuned-onednn``: the tuned choice between F.linear and oneDNN only, as before stream_linear;
``tuned``: the product's choice among all three paths) alternate ``--rounds`` times, in rotated
order, and the faster of each is kept: (1) the target's verify forward over a T-token tree after 256 tokens
(the premise of speculation: T tokens for about the price of one), (2) autoregressive
``generate_batch`` tokens/s at each batch size (32 new tokens). Writes
``bench/out/cpu_linear.json`` and ``.png``.
"""

import argparse
import json
import os
import sys
import time

import torch

MODES = ("stock", "tuned-onednn", "tuned")


def apply_mode(models, mode: str) -> None:
    """Set every linear of ``models`` to ``mode``'s paths."""
    from heterospec.models.linear import tune_linears, untune_linears
    if mode == "stock":
        untune_linears(models)
    else:
        tune_linears(models, stream=mode == "tuned")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--out", default="bench/out")
    args = p.parse_args(argv)

    from tqdm.auto import tqdm

    from heterospec import Engine
    from heterospec.bench import load_prompt_sets, machine_description, verify_latency_curve
    from heterospec.models.linear import tune_linears

    engine = Engine.from_pretrained()
    models = [engine.target, engine.draft]
    sets = load_prompt_sets(["mtbench", "alpaca"], max(args.batch_sizes), 0)
    prompts = [q.text for qs in sets.values() for q in qs]
    modes = list(dict.fromkeys(args.modes))
    verify = {m: {} for m in modes}
    ar = {m: {} for m in modes}
    outputs = {}        # batch size -> the distinct greedy outputs seen (one if modes and rounds agree)
    bar = tqdm(total=len(modes) * args.rounds, desc=" vs ".join(modes), unit="pass")
    for r in range(args.rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            apply_mode(models, mode)
            curve = verify_latency_curve(engine, sizes=args.sizes, repeats=5, out_dir=None)
            for T, ms in curve["latency_ms"].items():
                verify[mode][T] = min(verify[mode].get(T, float("inf")), ms)
            for B in args.batch_sizes:
                engine.generate_batch(prompts[:B], max_new_tokens=2, method="autoregressive")
                t0 = time.perf_counter()
                res = engine.generate_batch(prompts[:B], max_new_tokens=32, method="autoregressive")
                tps = sum(len(x.token_ids) for x in res) / (time.perf_counter() - t0)
                ar[mode][B] = max(ar[mode].get(B, 0.0), tps)
                outputs.setdefault(B, set()).add(tuple(tuple(x.token_ids) for x in res))
            bar.update(1)
    bar.close()
    tune_linears(models)
    same = all(len(o) == 1 for o in outputs.values())
    rows = {"verify_ms": {m: {T: verify[m][T] for T in args.sizes} for m in verify},
            "verify_vs_one_token": {m: {T: verify[m][T] / verify[m][args.sizes[0]] for T in args.sizes} for m in verify},
            "ar_tokens_per_s": {m: {B: ar[m][B] for B in args.batch_sizes} for m in ar}}
    result = {"machine": machine_description(engine.device), "threads": torch.get_num_threads(),
              "rounds": args.rounds, "same_greedy_tokens": same, **rows}
    print(f"machine: {result['machine']}, {result['threads']} threads")
    base = modes[0]
    print("| tree tokens T | " + " | ".join(f"{m} ms" for m in modes) + " | "
          + " | ".join(f"{base} / {m}" for m in modes[1:]) + " | " + " | ".join(f"T vs 1 token ({m})" for m in modes)
          + " |")
    print("|---" * (3 * len(modes)) + "|")
    for T in args.sizes:
        print(f"| {T} | " + " | ".join(f"{verify[m][T]:.1f}" for m in modes) + " | "
              + " | ".join(f"{verify[base][T] / verify[m][T]:.2f}x" for m in modes[1:]) + " | "
              + " | ".join(f"{rows['verify_vs_one_token'][m][T]:.2f}x" for m in modes) + " |")
    print("| batch | " + " | ".join(f"AR {m} tok/s" for m in modes) + " | "
          + " | ".join(f"{m} / {base}" for m in modes[1:]) + " |")
    print("|---" * (2 * len(modes)) + "|")
    for B in args.batch_sizes:
        print(f"| {B} | " + " | ".join(f"{ar[m][B]:.1f}" for m in modes) + " | "
              + " | ".join(f"{ar[m][B] / ar[base][B]:.2f}x" for m in modes[1:]) + " |")
    print(f"greedy tokens identical in every mode: {same}")
    if args.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cpu_linear.json"), "w") as f:
            json.dump(result, f, indent=1)
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for m in modes:
            axes[0].plot(args.sizes, [verify[m][T] for T in args.sizes], marker="o", label=m)
            axes[1].plot(args.batch_sizes, [ar[m][B] for B in args.batch_sizes], marker="o", label=m)
        axes[0].set(xscale="log", xlabel="tree tokens verified in one forward", ylabel="ms",
                    title="target verify forward (context 256)")
        axes[1].set(xscale="log", xlabel="batch size", ylabel="tokens/s", title="autoregressive decoding")
        for a in axes:
            a.legend()
            a.grid(alpha=0.3)
        fig.suptitle(f"CPU linear layers: F.linear vs tuned - {result['machine']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "cpu_linear.png"), dpi=120)
        print(f"wrote {args.out}/cpu_linear.json {args.out}/cpu_linear.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
