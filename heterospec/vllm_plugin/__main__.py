"""``python -m heterospec.vllm_plugin``: helpers for running HeteroSpec inside vLLM.

    paths       the built-in pair's target and draft directories (the target is fetched and
                converted on first use), as JSON
    tp-draft    a copy of an EAGLE-3 draft whose vocabulary vLLM can shard across --tp
                tensor-parallel ranks (the shipped draft's 8,192 rows do not split in 3, the
                built-in target's 9 heads split in 3 only; see tp_draft.py)
    generate    one vLLM engine (autoregressive, eagle3 with K draft tokens, or HeteroSpec) on a
                JSON list of prompts at one or more batch sizes (and, with --runs, several
                greedy or seeded runs one after another); prints one JSON line per run and
                batch size: token ids, tokens, seconds. Used by the tests and bench/vllm_compare.py,
                one process per engine (vLLM starts its engine core per ``LLM``). With
                ``--serve`` the engine stays up after its warm-up (``{"ready": true}``) and
                runs the requests read from stdin, one JSON line each (``{"prompts": [i, ...]}``:
                indices into --prompts, submitted together), answering one JSON line each:
                several engines then take turns on the same prompts (bench/vllm_compare.py
                --interleave), so that the machine's drift hits them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional


def _paths() -> dict:
    from ..defaults import default_draft_dir, default_target_dir
    return {"target": str(default_target_dir()), "draft": str(default_draft_dir())}


# What one engine of the built-in pair needs on CPU: float32 weights (~0.6 GiB), activations and
# a KV cache for a few sequences of --max-model-len.
CPU_MEMORY_BUDGET_GIB = 3.5


def default_memory_fraction(node_bytes: int | None = None, budget_gib: float = CPU_MEMORY_BUDGET_GIB) -> float:
    """vLLM's ``gpu_memory_utilization`` for a CPU engine: on CPU vLLM takes it as the fraction
    of NUMA node 0's memory that the engine may use, weights included. A fixed fraction fits one
    machine only (on a small node it left no room for the KV cache), so
    the fraction gives the engine ``budget_gib`` of this machine's node (at most 90 %)."""
    if node_bytes is None:
        node_bytes = 0
        try:
            with open("/sys/devices/system/node/node0/meminfo") as f:
                for line in f:
                    if "MemTotal:" in line:
                        node_bytes = int(line.split()[-2]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        if node_bytes <= 0:
            try:
                node_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (OSError, ValueError, AttributeError):
                return 0.15
    return round(min(0.9, max(0.05, budget_gib * (1 << 30) / node_bytes)), 3)


def call_groups(batch_sizes, n: int, continuous: bool = False) -> list:
    """``(b, prompt indices)`` of each call: groups of ``b`` of the ``n`` prompts per batch size
    ``b`` (each run to its last request's end), or with ``continuous`` all ``n`` in one call at
    the largest ``b`` > 1 (vLLM keeps ``b`` running, max_num_seqs)."""
    out = []
    for b in batch_sizes:
        if continuous and b == max(batch_sizes) and b > 1:
            out.append((b, list(range(n))))
        else:
            out += [(b, list(range(s, min(s + b, n)))) for s in range(0, n, b)]
    return out


def _generate(args) -> int:
    runs = _runs(args)        # (a bad --runs fails before vLLM's import and its engine's start)
    engine_args = _engine_args(args)
    if args.executor == "uni":
        # the engine core in this process too (vLLM otherwise spawns it, and it spawns the worker:
        # each a new interpreter importing vLLM)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    paths = _paths()
    target = args.target or paths["target"]
    draft = args.draft or paths["draft"]
    with open(args.prompts) as f:
        prompts = json.load(f)
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise SystemExit("generate: --prompts must be a JSON list of strings")
    spec, extra = None, {}
    if args.method in ("eagle3", "heterospec"):
        spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": args.k}
    if args.method == "heterospec":
        extra = {"heterospec": {}}
    max_seqs = max(args.batch)
    if args.method == "heterospec" and args.options:
        extra["heterospec"] = json.loads(args.options)
    llm = LLM(model=target, speculative_config=spec, additional_config=extra, dtype=args.dtype,
              max_model_len=args.max_model_len, max_num_seqs=max_seqs, enforce_eager=True, seed=0,
              tensor_parallel_size=args.tp, distributed_executor_backend=args.executor,
              gpu_memory_utilization=(args.memory_fraction if args.memory_fraction is not None
                                      else default_memory_fraction()),
              async_scheduling=False, disable_log_stats=False, **engine_args)

    def preemptions() -> float:
        try:
            return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions" and hasattr(m, "value"))
        except Exception:        # metrics are a report, never a failure
            return 0.0

    def spec_counters() -> dict:
        """vLLM's own speculative-decoding counters (drafts, draft tokens, accepted tokens, and
        per draft position the drafts whose token there was accepted: a list)."""
        out = {}
        try:
            for m in llm.get_metrics():
                if m.name.startswith("vllm:spec_decode_num_") and (hasattr(m, "value") or hasattr(m, "values")):
                    value = m.value if hasattr(m, "value") else list(m.values)
                    add_counters(out, {m.name.removeprefix("vllm:spec_decode_"): value})
        except Exception:        # metrics are a report, never a failure
            pass
        return out
    msgs = [[{"role": "user", "content": p}] for p in prompts]

    def params(i, run):
        extra = dict(run.get("params") or {})
        if "structured_outputs" in extra:
            from vllm.sampling_params import StructuredOutputsParams
            extra["structured_outputs"] = StructuredOutputsParams(**extra["structured_outputs"])
        extra.setdefault("ignore_eos", args.ignore_eos)
        mnt = run["max_new_tokens"]
        return SamplingParams(temperature=run["temperature"], max_tokens=mnt[i % len(mnt)] if isinstance(mnt, list) else mnt,
                              seed=(run["seed"] + i) if run["seed"] is not None else None, **extra)

    if args.warmup:   # compile caches, allocator, and HeteroSpec's first cost measurements
        llm.chat(msgs[:2], [SamplingParams(temperature=0, max_tokens=args.warmup) for _ in msgs[:2]], use_tqdm=False)

    def timed(groups, run) -> dict:
        """Each group of prompt indices submitted as one call (vLLM schedules up to max_num_seqs
        of it at once): token ids, tokens, seconds and vLLM's speculative counters of them all."""
        before, t0, outs, pre = spec_counters(), time.perf_counter(), [], preemptions()
        for idx in groups:
            outs += llm.chat([msgs[i] for i in idx], [params(i, run) for i in idx], use_tqdm=False)
        dt, after = time.perf_counter() - t0, spec_counters()
        ids = [list(o.outputs[0].token_ids) for o in outs]
        res = {"seconds": dt, "tokens": sum(len(c.token_ids) for o in outs for c in o.outputs), "token_ids": ids,
               "spec": add_counters(after, before, sign=-1), "preemptions": preemptions() - pre}
        if any(len(o.outputs) > 1 for o in outs):     # n > 1: every completion
            res["all_token_ids"] = [[list(c.token_ids) for c in o.outputs] for o in outs]
        if any(o.outputs[0].logprobs for o in outs):  # per position of the first completion: (token, logprob) pairs
            res["logprobs"] = [[sorted(((t, lp.logprob) for t, lp in pos.items()), key=lambda x: -x[1])
                                for pos in (o.outputs[0].logprobs or [])] for o in outs]
        return res

    if args.serve:
        import heterospec     # which checkout this engine runs (bench/vllm_compare.py --baseline)
        print(json.dumps({"ready": True, "heterospec": os.path.dirname(os.path.abspath(heterospec.__file__))}),
              flush=True)
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(timed([json.loads(line)["prompts"]], runs[0])), flush=True)
        return 0
    groups = call_groups(args.batch, len(msgs), args.continuous)
    for i, run in enumerate(runs):
        for b in args.batch:      # batch b: b prompts per call (--continuous: all of them, b running at once)
            if run.get("batches") and b not in run["batches"]:
                continue
            print(json.dumps({"method": args.method, "k": args.k if spec else 0, "batch": b, "run": i,
                              **timed([idx for gb, idx in groups if gb == b], run)}), flush=True)
    return 0


RUN_KEYS = ("max_new_tokens", "temperature", "seed", "params", "batches")
# what --engine-args may set of vLLM's engine beside the flags: its scheduling under pressure
ENGINE_ARGS = ("max_num_batched_tokens", "enable_chunked_prefill", "num_gpu_blocks_override", "enable_prefix_caching",
               "block_size")
# what a run's "params" may set of vLLM's SamplingParams beside the flags (structured_outputs: the
# keyword arguments of vLLM's StructuredOutputsParams, e.g. {"choice": [...]} or {"json": schema})
RUN_PARAMS = ("stop", "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
              "ignore_eos", "n", "top_p", "top_k", "structured_outputs")


def add_counters(total: dict, counters: Optional[dict], sign: int = 1) -> dict:
    """``total`` plus (``sign`` -1: minus) ``counters``, key by key, in place: numbers, and lists
    (vLLM's per-position counters) element by element, the shorter one padded with zeros."""
    for k, v in (counters or {}).items():
        old = total.get(k, [] if isinstance(v, list) else 0)
        if isinstance(v, list):
            n = max(len(old), len(v))
            old, v = list(old) + [0] * (n - len(old)), list(v) + [0] * (n - len(v))
            total[k] = [a + sign * b for a, b in zip(old, v)]
        else:
            total[k] = old + sign * v
    return total


def _engine_args(args) -> dict:
    """``--engine-args``: keyword arguments of vLLM's ``LLM`` of :data:`ENGINE_ARGS`."""
    try:
        out = json.loads(args.engine_args) if getattr(args, "engine_args", None) else {}
    except json.JSONDecodeError as e:
        raise SystemExit(f"generate: --engine-args is not JSON ({e})")
    if not isinstance(out, dict) or set(out) - set(ENGINE_ARGS):
        raise SystemExit(f"generate: --engine-args must be an object with keys of {', '.join(ENGINE_ARGS)}, "
                         f"got {args.engine_args}")
    return out


def _runs(args) -> list:
    """The runs of ``generate`` on its one engine: ``--runs`` (a JSON list of objects with keys of
    :data:`RUN_KEYS`; a key left out takes its flag's value), else one run of the flags."""
    flags = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed}
    if args.runs is None:
        return [flags]
    try:
        runs = json.loads(args.runs)
    except json.JSONDecodeError as e:
        raise SystemExit(f"generate: --runs is not JSON ({e})")
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) for r in runs):
        raise SystemExit("generate: --runs must be a non-empty JSON list of objects")
    for r in runs:
        unknown = sorted(set(r) - set(RUN_KEYS))
        if unknown:
            raise SystemExit(f"generate: --runs: unknown keys {unknown}; a run has {', '.join(RUN_KEYS)}")
        if not isinstance(r.get("params", {}), dict) or set(r.get("params", {})) - set(RUN_PARAMS):
            raise SystemExit(f"generate: --runs: 'params' must be an object with keys of {', '.join(RUN_PARAMS)}, "
                             f"got {r['params']!r}")
        if "batches" in r and not (isinstance(r["batches"], list) and all(b in args.batch for b in r["batches"])):
            raise SystemExit(f"generate: --runs: 'batches' must be a list of --batch sizes {args.batch}, got {r['batches']!r}")
        mnt = r.get("max_new_tokens", 1)
        if not (isinstance(mnt, int) or isinstance(mnt, list) and mnt and all(isinstance(m, int) for m in mnt)):
            raise SystemExit(f"generate: --runs: 'max_new_tokens' must be an integer or a list of them (per prompt), got {mnt!r}")
    return [{**flags, **r} for r in runs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m heterospec.vllm_plugin", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("paths", help="print the built-in target and draft directories (JSON), or one of them")
    pp.add_argument("which", nargs="?", choices=["target", "draft"], help="print only this directory")
    g = sub.add_parser("generate", help="run one vLLM engine on prompts (JSON lines out)")
    g.add_argument("--method", choices=["autoregressive", "eagle3", "heterospec"], required=True)
    g.add_argument("--k", type=int, default=6, help="num_speculative_tokens (eagle3: fixed; heterospec: the most)")
    g.add_argument("--prompts", required=True, help="JSON file: a list of prompt strings")
    g.add_argument("--batch", type=int, nargs="+", default=[1])
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="per-request seeds seed, seed+1, ...")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--runs", default=None,
                   help="several runs on the one engine, one after another: a JSON list of objects "
                        f"with keys {', '.join(RUN_KEYS)} (a key left out: its flag; max_new_tokens may "
                        "be a list, per prompt; params: more SamplingParams, of "
                        f"{', '.join(RUN_PARAMS)}; batches: the --batch sizes it runs at); output lines "
                        "carry \"run\" (its index)")
    g.add_argument("--warmup", type=int, default=0, help="tokens of a 2-prompt warm-up (not timed)")
    g.add_argument("--continuous", action="store_true",
                   help="the largest --batch B: all prompts in one call, B running at once (default: calls of B)")
    g.add_argument("--serve", action="store_true",
                   help="after the warm-up, run the requests read from stdin (JSON lines {\"prompts\": [i, ...]})")
    g.add_argument("--options", default=None, help="HeteroSpec options as JSON (additional_config['heterospec'])")
    g.add_argument("--target", default=None)
    g.add_argument("--draft", default=None)
    g.add_argument("--dtype", default="float32")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor_parallel_size (the built-in target splits in 3; the draft then needs `tp-draft`)")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--executor", choices=["mp", "uni"], default=None,
                   help="vLLM's executor: mp (a worker process per rank), uni (--tp 1 only: the "
                        "engine and its worker in this process, no start-up of two more "
                        "interpreters); default: vLLM's choice")
    g.add_argument("--engine-args", default=None,
                   help="more of vLLM's engine arguments as JSON, of " + ", ".join(ENGINE_ARGS) +
                        " (e.g. a small KV cache that preempts, chunked prefill)")
    g.add_argument("--memory-fraction", type=float, default=None,
                   help="vLLM's gpu_memory_utilization (on CPU: the fraction of NUMA node 0's memory "
                        f"for the engine; default: {CPU_MEMORY_BUDGET_GIB} GiB of it)")
    t = sub.add_parser("tp-draft", help="write a copy of an EAGLE-3 draft whose vocabulary vLLM can shard across "
                                         "--tp tensor-parallel ranks")
    t.add_argument("--tp", type=int, required=True, help="tensor_parallel_size the draft will run at")
    t.add_argument("--out", required=True, help="the new draft directory")
    t.add_argument("--draft", default=None, help="the draft to copy (default: the built-in one)")
    t.add_argument("--target", default=None, help="its target (default: the built-in one)")
    args = p.parse_args(argv)
    if args.command == "tp-draft":
        from .tp_draft import write_tp_draft
        paths = _paths() if args.draft is None or args.target is None else {}
        try:
            info = write_tp_draft(args.draft or paths["draft"], args.target or paths["target"], args.out, args.tp)
        except ValueError as e:
            p.error(f"tp-draft: {e}")
        print(json.dumps({k: v for k, v in info.items() if k != "added_target_ids"}))
        return 0
    if args.command == "paths":
        paths = _paths()
        print(paths[args.which] if args.which else json.dumps(paths))
        return 0
    if args.k < 1:
        p.error("--k must be >= 1")
    if args.tp < 1:
        p.error("--tp must be >= 1")
    if args.executor == "uni" and args.tp > 1:
        p.error("--executor uni runs one rank in this process: it needs --tp 1 (use --executor mp)")
    if args.tp > 1 and (os.cpu_count() or 1) < args.tp:
        # vLLM's CPU workers pin their OpenMP threads to cores of their own by default; with more
        # ranks than cores they share the cores instead
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return _generate(args)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
