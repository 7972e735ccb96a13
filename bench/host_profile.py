"""Where the host's time goes in a call of each method: cProfile over a few warmed-up calls.

On a GPU a round of the built-in pair is launch- and host-bound (a replayed round ~7-9 ms on an
H100, its parts timed by `bench/gpu_latency.py --split-only`); this says which Python functions
the host spends it in, per method, so that the policy's share (``policy_ms_per_call`` of
bench/e2e.py) can be taken apart. Runs on any device (on the CPU the target's forward dominates).

    python bench/host_profile.py --device cuda --dtype bfloat16 --out host_profile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from heterospec.bench import BENCH_METHODS


def profile_method(engine, method: str, prompts, max_new_tokens: int, top: int) -> str:
    from heterospec.bench import bench_call

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    prof = cProfile.Profile()
    tokens, t0 = 0, time.perf_counter()
    prof.enable()
    for p in prompts:
        tokens += len(engine.generate(p, max_new_tokens=max_new_tokens, **bench_call(method)).token_ids)
    sync()
    prof.disable()
    wall = time.perf_counter() - t0
    out = io.StringIO()
    out.write(f"## {method}: {len(prompts)} calls, {tokens} tokens, {wall:.3f} s under cProfile "
              f"({tokens / wall:.1f} tok/s; the profiler slows Python)\n\n")
    for key in ("tottime", "cumulative"):
        out.write(f"### by {key}\n```\n")
        pstats.Stats(prof, stream=out).strip_dirs().sort_stats(key).print_stats(top)
        out.write("```\n\n")
    return out.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 / float16 / float32 (default: the engine's)")
    p.add_argument("--methods", nargs="+", default=["heterospec", "eagle3", "autoregressive"],
                   choices=BENCH_METHODS)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=30, help="functions listed per table")
    p.add_argument("--out", help="write the Markdown report here (else stdout)")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.top < 1:
        p.error("--max-new-tokens and --top must be >= 1")

    import heterospec
    from heterospec.bench import WARMUP_PROMPTS, bench_call, machine_description

    engine = heterospec.Engine.from_pretrained(device=args.device, dtype=args.dtype)
    prompts = list(WARMUP_PROMPTS)
    for m in args.methods:   # warm-up: captures, caches, the policy's first fits
        for w in prompts:
            engine.generate(w, max_new_tokens=args.max_new_tokens, **bench_call(m))
    # (on a CPU the machine's description names torch already)
    version = f"; torch {torch.__version__}" if engine.device.type == "cuda" else ""
    report = [f"# Host profile, {machine_description(engine.device)}{version}; "
              f"{engine.device} {next(engine.target.parameters()).dtype}\n\n"]
    report += [profile_method(engine, m, prompts, args.max_new_tokens, args.top) for m in args.methods]
    text = "".join(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
