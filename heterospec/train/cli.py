"""``heterospec train-draft`` / ``scripts/train_draft.py``: argument parsing for the draft
training pipeline (distill -> vocab -> train -> simulate -> export). See ``main.__doc__``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..argtypes import fraction, nonneg_int, positive_float, positive_int, seed
from . import default_ttt_steps

DISTILL_NUM_PROMPTS = 16000   # = prompts.DISTILL_NUM_PROMPTS (not imported: keeps --help light)


def _mix(text: str) -> dict:
    """``instruct=0.4,chat=0.15,...`` -> {source: weight}."""
    out = {}
    for part in text.split(","):
        name, sep, w = part.partition("=")
        try:
            val = float(w)
        except ValueError:
            val = -1.0
        if not sep or not name.strip() or not val > 0:
            raise argparse.ArgumentTypeError(f"expected SOURCE=WEIGHT,... with weights > 0, got {text!r}")
        out[name.strip()] = val
    return out


def _default_data() -> str:
    from .distill import default_distill_dir

    return str(default_distill_dir())


def _default_run() -> str:
    from ..defaults import cache_root

    return str(cache_root() / "draft-runs" / "default")


def build_parser(prog: str = "heterospec train-draft") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=(
        "Train the EAGLE-3 draft of the built-in target by self-distillation. Steps: distill "
        "(or pack), vocab, train, simulate, export (each resumable)."),
        epilog=f"`{prog} STEP --help` lists the options of one step.")
    # not required=True: main() names the missing step itself, after unknown options are reported
    sub = ap.add_subparsers(dest="cmd", metavar="STEP", title="steps")

    def common(p):
        p.add_argument("--threads", type=positive_int, default=1,
                       help="torch threads (default 1 so the box stays usable; raise when free)")
        p.add_argument("--target", default=None,
                       help="target HF dir (default: the built-in SmolLM2, converted on first use)")

    p = sub.add_parser("distill", help="generate self-distillation shards")
    common(p)
    p.add_argument("--out", default=None, help="data dir (default ~/.cache/heterospec/distill)")
    p.add_argument("--num-prompts", type=positive_int, default=DISTILL_NUM_PROMPTS,
                   help="prompts before the disjointness check (default %(default)s: >= 2.5M "
                        "response tokens)")
    p.add_argument("--mix", type=_mix, default=None,
                   help="prompt sources and weights, e.g. instruct=0.4,code=0.17,docs=0.15,"
                        "math=0.13,chat=0.15 (default: prompts.DISTILL_MIX)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="target precision; auto = bfloat16 on CUDA or a CPU with native bf16, "
                        "else float32")
    p.add_argument("--allow-missing-references", action="store_true",
                   help="run the disjointness check with the benchmark sets that are available "
                        "(a missing one is reported, not checked); default: refuse")
    p.add_argument("--shard-size", type=positive_int, default=64)
    p.add_argument("--max-new-tokens", type=positive_int, default=320)
    p.add_argument("--max-prompt-tokens", type=positive_int, default=448)
    p.add_argument("--sampled-fraction", type=fraction, default=0.25)
    p.add_argument("--temperature", type=positive_float, default=0.7)
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--max-shards", type=positive_int, default=None)
    p.add_argument("--time-budget", type=positive_float, default=None, help="seconds; stop starting shards after")
    p.add_argument("--no-taps", action="store_true",
                   help="write token-only shards (~2 bytes a token; the trainer recomputes the "
                        "taps), e.g. straight into the data set kept in git: --out data/distill-v2")
    p.add_argument("--skip-answered", nargs="+", default=(), metavar="DIR",
                   help="leave out the prompts whose ids the shards in these data dirs answered "
                        "already (e.g. a plan begun on another machine)")

    p = sub.add_parser("selfchat", help="let the target write user requests (the selfchat prompt "
                                        "source); resumable")
    common(p)
    p.add_argument("--out", default=None, help="JSONL file (default ~/.cache/heterospec/selfchat/user_turns.jsonl)")
    p.add_argument("--num-samples", type=positive_int, default=8192, help="turns to sample (kept or not)")
    p.add_argument("--batch", type=positive_int, default=64, help="turns sampled together (one chunk)")
    p.add_argument("--max-new-tokens", type=positive_int, default=160)
    p.add_argument("--temperature", type=positive_float, default=1.0)
    p.add_argument("--top-p", type=fraction, default=0.95)
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--time-budget", type=positive_float, default=None, help="seconds; stop starting chunks after")
    p.add_argument("--openings", choices=("none", "tasks"), default="none",
                   help="tasks: each chunk's turns start with the first words of one kind of request "
                        "(writing, roleplay, reasoning, math, coding, extraction, STEM, humanities, "
                        "summarisation) and the target writes the rest (default: none, the target "
                        "writes the whole request)")

    p = sub.add_parser("pack", help="token-only copies of distilled shards (for git: the taps "
                                    "are recomputed when training)")
    p.add_argument("--data", default=None, help="source data dir (default ~/.cache/heterospec/distill-v2)")
    p.add_argument("--out", required=True, help="destination dir, e.g. data/distill-v2")

    p = sub.add_parser("corpus", help="the lookup corpus shipped next to the draft: the target's greedy "
                                      "answers in distilled data (heterospec.datastore)")
    p.add_argument("--data", nargs="+", required=True, help="distilled data directories (data/distill-v*)")
    p.add_argument("--out", required=True, help="file to write, e.g. DRAFT_DIR/lookup_corpus.npz")
    p.add_argument("--head", type=int, default=3, help="prompt tokens kept before each answer (default %(default)s: "
                                                      "the chat template's assistant header)")

    p = sub.add_parser("references", help="write the benchmark sets' texts to one file, for a machine "
                                          "that cannot fetch them (its distill reads it from "
                                          "$HETEROSPEC_DISJOINT_REFS)")
    p.add_argument("--out", required=True, help="file to write (gzipped JSON)")

    p = sub.add_parser("bench-distill", help="measure distillation speed (response tokens/s); "
                                             "writes nothing")
    common(p)
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument("--batch", type=positive_int, default=32, help="prompts per target forward")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--time-budget", type=positive_float, default=60.0,
                   help="seconds; no new batch starts after (default %(default)s)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])

    p = sub.add_parser("vocab", help="choose the draft vocabulary from the distilled responses")
    p.add_argument("--data", default=None)
    p.add_argument("--size", type=positive_int, default=8192)
    p.add_argument("--out", default=None, help="default DATA/vocab_SIZE.safetensors")

    p = sub.add_parser("train", help="train (or resume) the draft")
    common(p)
    p.add_argument("--device", default="auto",
                   help="where the draft trains and the taps are recomputed: auto (cuda if available), "
                        "cpu, cuda, cuda:N")
    p.add_argument("--data", default=None)
    p.add_argument("--run", default=None, help="run dir (checkpoints, logs)")
    p.add_argument("--vocab-size", type=positive_int, default=8192)
    p.add_argument("--steps", type=positive_int, default=3000)
    p.add_argument("--batch-tokens", type=positive_int, default=2048)
    p.add_argument("--max-len", type=positive_int, default=768)
    p.add_argument("--ttt-steps", type=positive_int, default=default_ttt_steps(),
                   help="training-time-test unrolled steps (default %(default)s: every candidate "
                        "layer of the deepest draft tree the engine builds); may change on resume")
    p.add_argument("--lr", type=positive_float, default=2e-3)
    p.add_argument("--warmup", type=nonneg_int, default=30)
    p.add_argument("--min-lr-ratio", type=fraction, default=0.1,
                   help="the cosine decay ends at this fraction of --lr (1: a constant rate after "
                        "warmup)")
    p.add_argument("--val-seqs", type=positive_int, default=32)
    p.add_argument("--eval-every", type=positive_int, default=150)
    p.add_argument("--ckpt-every", type=positive_int, default=25)
    p.add_argument("--time-budget", type=positive_float, default=None,
                   help="seconds of train-step time (evals excluded); the LR schedule follows it")
    p.add_argument("--stop-at", type=positive_float, default=None, metavar="EPOCH_S",
                   help="wall-clock time (epoch seconds) after which no step starts: the run "
                        "checkpoints and evaluates as at its end (a job's deadline, whatever "
                        "loading, evaluations and checkpoints took)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--amp", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="mixed precision of the draft's forward/backward; auto = bfloat16 "
                        "autocast on a CPU with native bf16 (about 2x faster there), else float32")
    p.add_argument("--taps-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="precision of the target forward that recomputes token-only shards' taps")
    p.add_argument("--train-lm-head", action="store_true",
                   help="train the draft's lm_head (its draft-vocabulary rows start as the target's "
                        "output rows) instead of keeping it frozen; about a quarter more compute a step")
    p.add_argument("--init", default=None, metavar="DRAFT",
                   help="warm start a new run from an earlier draft (an exported draft dir, e.g. "
                        "the shipped one, or a ckpt_*.pt); the draft vocabulary may differ. "
                        "Ignored when the run resumes")
    p.add_argument("--init-layer", type=int, default=None, metavar="N",
                   help="initialise a new draft's decoder layer from target layer N (negative "
                        "counts from the end; -3 is the layer whose input is the draft's high tap) "
                        "instead of at random; not with --init. Ignored when the run resumes")

    p.add_argument("--intermediate-size", type=positive_int, default=None, metavar="N",
                   help="the draft MLP's width (default: the --init draft's, else the target's); "
                        "wider than the --init draft's, that draft's units are copied into the "
                        "first ones and the new ones start silent (the same function at step 0). "
                        "A resumed run keeps its own")

    p = sub.add_parser("simulate", help="offline chain/tree acceptance estimate on held-out data")
    common(p)
    p.add_argument("--data", default=None)
    p.add_argument("--run", default=None)
    p.add_argument("--checkpoint", default=None, help="a checkpoint file or exported draft dir")
    p.add_argument("--seqs", type=positive_int, default=24)
    p.add_argument("--top-k", type=positive_int, default=6)
    p.add_argument("--depth", type=nonneg_int, default=6)
    p.add_argument("--nodes", type=positive_int, default=24, help="verified draft nodes (root excluded)")
    p.add_argument("--prompts", default=None,
                   help="evaluate on a benchmark set from heterospec.datasets instead (e.g. mtbench): "
                        "the target answers greedily in memory (nothing is saved or trained on)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)

    p = sub.add_parser("export", help="save the trained draft (fp16, public EAGLE-3 format)")
    common(p)
    p.add_argument("--run", default=None)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--dest", default=None, help="default heterospec/assets/smollm2-135m-instruct-eagle3")
    p.add_argument("--vocab", default=None,
                   help="export over this draft vocabulary (a `vocab` output); frozen-lm_head runs only")
    return ap


def main(argv=None) -> int:
    """Entry point; ``argv`` excludes the program name."""
    ap = build_parser()
    args, unknown = ap.parse_known_args(argv)
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.cmd is None:
        ap.error("a step is required: selfchat, distill, bench-distill, references, pack, corpus, vocab, train, "
                 "simulate or export")
    if args.cmd == "bench-distill":
        from .distill import bench_generation

        res = bench_generation(args.num_prompts, args.batch, args.max_new_tokens, args.time_budget,
                               device=args.device, dtype=args.dtype, threads=args.threads,
                               target_dir=args.target)
        print(json.dumps(res, indent=1), flush=True)
        return 0
    if args.cmd == "distill":
        from .distill import DistillConfig, run_distill

        cfg = DistillConfig(out_dir=args.out or _default_data(), num_prompts=args.num_prompts,
                            shard_size=args.shard_size, max_new_tokens=args.max_new_tokens,
                            max_prompt_tokens=args.max_prompt_tokens,
                            sampled_fraction=args.sampled_fraction, temperature=args.temperature,
                            seed=args.seed, max_shards=args.max_shards,
                            time_budget_s=args.time_budget, threads=args.threads, mix=args.mix,
                            device=args.device, dtype=args.dtype,
                            allow_missing_references=args.allow_missing_references,
                            store_taps=not args.no_taps, skip_answered=tuple(args.skip_answered))
        print(json.dumps(run_distill(cfg, target_dir=args.target), indent=1), flush=True)
        return 0
    if args.cmd == "selfchat":
        import torch

        from .selfchat import default_selfchat_path, run_selfchat

        torch.set_num_threads(args.threads)
        res = run_selfchat(args.out or default_selfchat_path(), args.num_samples, batch=args.batch, seed=args.seed,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           target_dir=args.target, time_budget=args.time_budget, openings=args.openings)
        print(json.dumps(res, indent=1), flush=True)
        return 0
    if args.cmd == "references":
        from .disjoint import write_reference_file

        print(json.dumps(write_reference_file(args.out)), flush=True)
        return 0
    if args.cmd == "corpus":
        from .corpus import build_corpus

        print(json.dumps(build_corpus(args.data, args.out, head=args.head), indent=1), flush=True)
        return 0
    if args.cmd == "pack":
        from .distill import pack_shards

        print(json.dumps(pack_shards(args.data or _default_data(), args.out), indent=1), flush=True)
        return 0
    from . import trainer

    return trainer.cli_dispatch(args, default_data=_default_data, default_run=_default_run)


if __name__ == "__main__":
    sys.exit(main())
