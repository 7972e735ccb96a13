"""``heterospec`` command line: generate, calibrate, bench, verify-curve, train-draft."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from .engine import METHODS


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model pair (default: the built-in SmolLM2-135M-Instruct + shipped EAGLE-3 draft)")
    g.add_argument("--target", help="Hugging Face directory of a Llama-architecture target")
    g.add_argument("--draft", help="EAGLE-3 draft directory (public EAGLE-3 checkpoint format)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weight dtype (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="draft weight dtype (default: bfloat16 on CPUs with native bf16 and a float32 "
                        "target, else the target's; never changes the output, only speed and tau)")
    t = p.add_argument_group("tree (default: the device's shipped settings)")
    t.add_argument("--tree-top-k", type=int, dest="tree_top_k", help="children per expanded node (tree branching)")
    t.add_argument("--depth", type=int, help="tree-expansion draft forwards per round")
    t.add_argument("--total-tokens", type=int, help="verified nodes per round, root included")
    t.add_argument("--alpha", type=int, help="HeteroSpec extra-depth scale (default ceil(depth/2))")


def _engine(args):
    import torch

    from .config import default_config
    from .engine import Engine

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.startswith("cuda") else None)
    cfg = default_config(torch.device(device))
    changes = {k: v for k, v in (("top_k", args.tree_top_k), ("depth", args.depth),
                                 ("total_tokens", args.total_tokens), ("alpha", args.alpha)) if v is not None}
    if changes:
        cfg = cfg.replace(**changes)
    if args.target is None and args.draft is not None:
        raise SystemExit("--draft needs --target (the built-in draft belongs to the built-in target)")
    draft_dtype = getattr(torch, args.draft_dtype) if args.draft_dtype else None
    return Engine.from_pretrained(args.target, args.draft, device=device, dtype=dtype, config=cfg,
                                  draft_dtype=draft_dtype)


def cmd_generate(args) -> int:
    engine = _engine(args)
    tok = engine.tokenizer
    methods = list(METHODS) if args.method == "all" else [args.method]
    for method in methods:
        if len(methods) > 1:
            print(f"=== {method} ===", flush=True)
        stream = None
        if args.stream and tok is not None:
            state = {"ids": [], "text": ""}

            def stream(ids, state=state):
                state["ids"].extend(ids)
                text = tok.decode(state["ids"], skip_special_tokens=True)
                sys.stdout.write(text[len(state["text"]):])
                sys.stdout.flush()
                state["text"] = text
        res = engine.generate(args.prompt, max_new_tokens=args.max_new_tokens, method=method,
                              temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              chat=not args.no_chat, stream=stream)
        if stream is not None:
            print()
        else:
            print(res.text if res.text is not None else res.token_ids)
        s = res.stats
        print(f"[{method}] {s.new_tokens} tokens in {s.total_s:.2f} s ({s.tokens_per_s:.1f} tok/s), "
              f"tau {s.tau:.2f}, target calls {s.target_calls}, verified tokens {s.verified_tokens}, "
              f"finish: {res.finish_reason}", file=sys.stderr, flush=True)
    return 0


def cmd_calibrate(args) -> int:
    engine = _engine(args)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts = [json.loads(l)["text"] if l.lstrip().startswith("{") else l.rstrip("\n") for l in f if l.strip()]
        source = os.path.abspath(args.prompts_file)
    else:
        from .train.prompts import calibration_prompts
        prompts, source = calibration_prompts(args.n, seed=args.seed)
    prompts = prompts[:args.n]
    out_dir = args.out or engine.draft_dir
    bins = engine.calibrate(prompts, max_new_tokens=args.max_new_tokens, label=args.label, source=source,
                            save=False)
    if out_dir:
        from .entropy import BINS_FILENAME
        os.makedirs(out_dir, exist_ok=True)
        bins.save(os.path.join(out_dir, BINS_FILENAME))
        print(f"wrote {os.path.join(out_dir, BINS_FILENAME)}")
    print(json.dumps(bins.to_dict(), indent=2))
    return 0


def cmd_bench(args) -> int:
    from .bench import run_e2e

    engine = _engine(args)
    run_e2e(engine, sets=args.sets, n=args.n, max_new_tokens=args.max_new_tokens, out_dir=args.out,
            methods=args.methods, seed=args.seed)
    return 0


def cmd_verify_curve(args) -> int:
    from .bench import verify_latency_curve

    engine = _engine(args)
    verify_latency_curve(engine, sizes=args.sizes, context=args.context, repeats=args.repeats, out_dir=args.out)
    return 0


def cmd_train_draft(args) -> int:
    from .train import main as train_main

    return int(train_main(args.rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="heterospec", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with one method (or compare all)")
    g.add_argument("prompt")
    g.add_argument("--method", default="heterospec", choices=list(METHODS) + ["all"])
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="sampling top-k of the target (0 = off)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    _add_model_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("calibrate", help="fit HeteroSpec's entropy bins for a model pair (CART, depth 3)")
    c.add_argument("--prompts-file", help="one prompt per line (or JSON lines with a 'text' key)")
    c.add_argument("--n", type=int, default=64, help="calibration prompts")
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--label", default="tcr", choices=["tcr", "pstar_rank"])
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", help="directory for entropy_bins.json (default: the draft's directory)")
    _add_model_args(c)
    c.set_defaults(func=cmd_calibrate)

    b = sub.add_parser("bench", help="autoregressive vs eagle3 vs heterospec on prompt sets")
    b.add_argument("--sets", nargs="+", default=["mtbench", "humaneval", "gsm", "alpaca", "cnndm"])
    b.add_argument("--methods", nargs="+", default=list(METHODS[::-1]), choices=list(METHODS))
    b.add_argument("--n", type=int, default=8, help="prompts per set")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default="bench/out", help="directory for the JSON, Markdown table and plots")
    _add_model_args(b)
    b.set_defaults(func=cmd_bench)

    v = sub.add_parser("verify-curve", help="verification latency vs tree tokens on this device")
    v.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 48, 64])
    v.add_argument("--context", type=int, default=256)
    v.add_argument("--repeats", type=int, default=5)
    v.add_argument("--out", default="bench/out")
    _add_model_args(v)
    v.set_defaults(func=cmd_verify_curve)

    t = sub.add_parser("train-draft", help="self-distil and train an EAGLE-3 draft (see heterospec.train)",
                       add_help=False)
    t.add_argument("rest", nargs=argparse.REMAINDER)
    t.set_defaults(func=cmd_train_draft)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"heterospec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
