"""vLLM autoregressive vs vLLM eagle3 (K = 1..5) vs vLLM + HeteroSpec vs our own engine, side by side.

Run in the vLLM environment (scripts/setup-vllm.sh), with nothing else running on the box:

    python bench/vllm_compare.py --n 8 --max-new-tokens 128 --batch 1 8 --out bench/out/vllm

Each vLLM engine runs in its own process (``python -m heterospec.vllm_plugin generate``: engine
start, a short untimed warm-up, then the N prompts at each batch size: batch 1 = one request at
a time, batch 8 = eight at once); our engine's three methods run in this process through
``Engine.generate_batch``.

One engine after another is what a new user sees, but the machine's speed drifts between
engines (the same vLLM configuration measured 15.8 and 20.6 tok/s in two runs minutes apart on
the AVX-512 box). ``--interleave`` keeps every vLLM engine up at once (``generate --serve``, each
with ``--memory-gib`` of memory) and lets them take turns on each group of prompts, the order
rotating from group to group, ``--repeats`` times: ratios from one interleaved run.
``--continuous`` runs the largest batch size B as a server under load runs: all N prompts in one
call, vLLM keeping B of them running and starting the next as one ends. By default each group of
B prompts runs to its last request's end (a static batch): its tail runs fewer than B requests,
and a method that speeds some requests more than others gains nothing there.
``--in-process`` runs each vLLM engine's core in its engine's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as offline ``LLM(...)`` can; ``vllm serve`` always splits):
on a CPU with few cores the split engine's two processes contend for them (docs/vllm.md). Each
HeteroSpec engine then learns its step costs from nothing into a file of its own in ``--out``
(a fresh process, as a new user's first run). ``--baseline DIR ...`` adds a HeteroSpec
engine per DIR running the plugin of that checkout of heterospec (e.g. a ``git worktree`` of the
previous commit), for before/after comparisons. Prints and writes a table of tokens/s and ratios to vLLM
autoregressive, the identity check of every method against its engine's autoregressive output,
and a bar plot. Float32 by default (``--dtype bfloat16``: every engine's target, and vLLM's
draft, in bfloat16; there vLLM's speculative engines may part from its autoregressive text at a
rounding tie, docs/vllm.md). Greedy by default; ``--temperature T`` samples instead (vLLM's top-k /
top-p off), ``--seed S`` gives request ``i`` the seed ``S + i`` in every engine: then vLLM +
HeteroSpec must write vLLM autoregressive's text (its exact-match verification), while vLLM's own
eagle3 and our engine draw differently per drafted token, so "same text" says NO for them there.
Without a seed sampled texts are not compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import List, Optional

from heterospec.vllm_plugin.__main__ import add_counters as add_spec   # sums one call's counters into a run's


def _preload() -> str:
    """tcmalloc + Intel OpenMP, as vLLM's CPU docs advise (its speculative decoding warns of a
    "significant performance loss" without libiomp5): the paths found, ':'-joined, or ''."""
    import glob
    found = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",) if os.path.exists(p)]
    found += glob.glob(os.path.join(sys.prefix, "lib", "libiomp5.so"))[:1]
    return ":".join(found)


def _sampling_args(args) -> list:
    """``generate``'s sampling arguments for this comparison."""
    out = ["--temperature", str(args.temperature)] if args.temperature > 0 else []
    return out + (["--seed", str(args.seed)] if args.seed is not None else [])


def _core_env(args) -> dict:
    """The environment that puts each vLLM engine's core in its own process or not (--in-process)."""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if args.in_process else {}


def _vllm_run(method: str, k: int, prompts_file: str, args) -> dict:
    cmd = [sys.executable, "-m", "heterospec.vllm_plugin", "generate", "--method", method, "--k", str(k),
           "--prompts", prompts_file, "--batch", *map(str, args.batch), "--max-new-tokens", str(args.max_new_tokens),
           "--warmup", "16", "--dtype", args.dtype, *_sampling_args(args),
           *(["--continuous"] if args.continuous else [])]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", **_core_env(args))
    if args.preload:
        env["LD_PRELOAD"] = args.preload
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"vLLM run {method} k={k} failed:\n{r.stderr[-3000:]}")
    return {o["batch"]: o for o in (json.loads(line) for line in r.stdout.splitlines() if line.startswith("{"))}


def acceptance_cells(spec: dict) -> Optional[List[str]]:
    """Drafts, draft tokens, accepted share, and each position's acceptance given the one before it
    accepted (from ``num_accepted_tokens_per_pos``), or None without drafts."""
    drafts, tokens = spec.get("num_drafts", 0), spec.get("num_draft_tokens", 0)
    if not drafts or not tokens:
        return None
    per = spec.get("num_accepted_tokens_per_pos") or []
    cond, prev = [], drafts
    for a in per:
        if prev <= 0:
            break
        cond.append(f"{a / prev:.2f}")
        prev = a
    return [f"{drafts:.0f}", f"{tokens:.0f}", f"{spec.get('num_accepted_tokens', 0) / tokens:.2f}",
            " / ".join(cond) or "-"]


def _vllm_interleaved(runs, prompts_file: str, n: int, args) -> dict:
    """Every engine of ``runs`` (label, method, k, extra env, HeteroSpec options) up at once; each group of prompts
    (b at a time per batch size b) run by every engine in turn, the order rotating."""
    from tqdm.auto import tqdm

    from heterospec.vllm_plugin.__main__ import call_groups, default_memory_fraction
    frac = default_memory_fraction(budget_gib=args.memory_gib)
    procs = {}
    try:
        for label, method, k, env_extra, opts in tqdm(runs, desc="starting vLLM engines", unit="engine"):
            # -P: the working directory (this checkout, if run from its root) does not come first on
            # sys.path, so PYTHONPATH picks the checkout each engine runs (--baseline)
            cmd = [sys.executable, "-P", "-m", "heterospec.vllm_plugin", "generate", "--method", method, "--k", str(k),
                   "--prompts", prompts_file, "--batch", str(max(args.batch)), "--max-new-tokens",
                   str(args.max_new_tokens), "--warmup", "16", "--serve", "--memory-fraction", str(frac),
                   "--dtype", args.dtype, *_sampling_args(args)]
            if method == "heterospec":
                costs = os.path.join(os.path.abspath(args.out), "costs-" + "".join(c if c.isalnum() else "_" for c in label) + ".json")
                if os.path.exists(costs):
                    os.remove(costs)           # a fresh process: step costs learned from nothing
                cmd += ["--options", json.dumps({"costs": costs, **opts})]
            env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", **_core_env(args), **env_extra)
            if args.preload:
                env["LD_PRELOAD"] = args.preload
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            procs[label] = proc
            want = (env_extra.get("PYTHONPATH") or "").split(os.pathsep)[0]
            for line in proc.stdout:
                if line.startswith("{") and json.loads(line).get("ready"):
                    ran = json.loads(line).get("heterospec")
                    if want and ran and os.path.realpath(ran) != os.path.realpath(os.path.join(want, "heterospec")):
                        raise SystemExit(f"vLLM engine {label} runs heterospec from {ran}, not from {want}")
                    break
            else:
                raise SystemExit(f"vLLM engine {label} exited before it was ready (rc {proc.wait()})")
        labels = [r[0] for r in runs]
        results = {(lab, b): {"seconds": 0.0, "tokens": 0, "token_ids": [], "spec": {},
                              "passes": [[0, 0.0] for _ in range(args.repeats)]}
                   for lab in labels for b in args.batch}
        groups = call_groups(args.batch, n, args.continuous)
        turns = [(rep, gi) for rep in range(args.repeats) for gi in range(len(groups))]
        for t, (rep, gi) in enumerate(tqdm(turns, desc="interleaved prompt groups", unit="group")):
            b, idx = groups[gi]
            for j in range(len(labels)):
                lab = labels[(t + j) % len(labels)]
                proc = procs[lab]
                proc.stdin.write(json.dumps({"prompts": idx}) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                while line and not line.startswith("{"):
                    line = proc.stdout.readline()
                if not line:
                    raise SystemExit(f"vLLM engine {lab} exited (rc {proc.wait()})")
                o, r = json.loads(line), results[(lab, b)]
                r["seconds"] += o["seconds"]
                r["tokens"] += o["tokens"]
                r["passes"][rep][0] += o["tokens"]
                r["passes"][rep][1] += o["seconds"]
                add_spec(r["spec"], o.get("spec"))
                if rep == 0:
                    r["token_ids"].extend(o["token_ids"])
        return results
    finally:
        for proc in procs.values():
            if proc.stdin:
                proc.stdin.close()
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _never_drafting_costs(out_dir: str) -> str:
    """A frozen step-cost file in which drafting costs far more than it could gain (plain steps
    100 ms, a speculative step 2-3 s, the drafter 1-2 s, at batch buckets 1 and 8): every plan
    the plugin fits from it is plain, and it never explores. Returns its path."""
    from heterospec.vllm_plugin.costs import StepCosts
    costs = StepCosts()
    for b in (1, 8):
        for _ in range(5):
            costs.add_target(b, b, 100.0)                                   # plain
            costs.add_target(b, 2 * b, 2000.0)                              # 1 draft token per request
            costs.add_target(b, 3 * b, 3000.0)                              # 2
            costs.add_draft(b, 0, 1000.0)
            costs.add_draft(b, 1, 2000.0)
    path = os.path.join(os.path.abspath(out_dir), "costs-never-drafts.json")
    costs.save(path)
    return path


def _ours(texts, args) -> dict:
    import torch

    from heterospec import Engine

    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(dtype=getattr(torch, args.dtype))
    out = {}
    for m in ("autoregressive", "eagle3", "heterospec"):
        engine.generate_batch(texts[:2], max_new_tokens=16, method=m)          # warm-up, untimed
    for m in ("autoregressive", "eagle3", "heterospec"):
        for b in args.batch:
            ids, t0 = [], time.perf_counter()
            for s in range(0, len(texts), b):
                res = engine.generate_batch(texts[s:s + b], max_new_tokens=args.max_new_tokens, method=m,
                                            temperature=args.temperature,
                                            seed=None if args.seed is None else args.seed + s)
                ids.extend(list(r.token_ids) for r in res)
            out[(m, b)] = {"seconds": time.perf_counter() - t0, "tokens": sum(len(x) for x in ids), "token_ids": ids}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8, help="prompts of the set (MT-bench: first turns)")
    p.add_argument("--set", default="mtbench", choices=["mtbench", "humaneval", "gsm", "alpaca", "cnndm"],
                   help="prompt set (heterospec.datasets)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the target's dtype in every engine (vLLM's dtype=; ours: Engine.from_pretrained(dtype=))")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="fixed K of vLLM eagle3")
    p.add_argument("--heterospec-k", type=int, default=6, help="HeteroSpec's longest chain in vLLM")
    p.add_argument("--heterospec-k-ab", type=int, nargs="+", default=[], metavar="K",
                   help="with --interleave: also run this checkout's plugin with these longest chains")
    p.add_argument("--threads", type=int, default=2, help="torch threads of our engine")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    p.add_argument("--seed", type=int, default=None,
                   help="with --temperature: request i gets seed SEED + i (our engine: one seed per batch call)")
    p.add_argument("--no-ours", action="store_true", help="skip our own engine")
    p.add_argument("--out", default="bench/out/vllm")
    p.add_argument("--ld-preload", choices=["auto", "none"], default="auto",
                   help="auto: preload tcmalloc and libiomp5 for the vLLM engines when installed (vLLM's CPU "
                        "advice; `pip install intel-openmp`, Debian libtcmalloc-minimal4)")
    p.add_argument("--interleave", action="store_true",
                   help="all vLLM engines up at once, taking turns on each group of prompts (see above)")
    p.add_argument("--in-process", action="store_true",
                   help="run each vLLM engine's core in the engine's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), "
                        "as offline LLM(...) can; default: vLLM's split engine, as `vllm serve` runs")
    p.add_argument("--continuous", action="store_true",
                   help="the largest batch size B runs all N prompts in one call, vLLM keeping B of them running "
                        "(continuous batching, as `vllm serve` under load); default: groups of B prompts, each run "
                        "to its last request's end (static batches, whose tail runs below B)")
    p.add_argument("--repeats", type=int, default=1, help="with --interleave: passes over the prompts")
    p.add_argument("--memory-gib", type=float, default=1.5, help="with --interleave: memory of each vLLM engine")
    p.add_argument("--path-stop-ab", action="store_true",
                   help="with --interleave: also run this checkout's plugin with path_stop off (bins' fixed lengths)")
    p.add_argument("--never-drafts", action="store_true",
                   help="with --interleave: also run the plugin with frozen step costs that make every plan "
                        "plain (the drafter runs over prefills only): what a step costs in vLLM's speculative "
                        "mode when nothing is drafted, against vLLM autoregressive")
    p.add_argument("--lean-steps-ab", action="store_true",
                   help="with --interleave: also run each plugin engine of this checkout with lean_steps off "
                        "(vLLM's own step path: the rejection sampler on steps without drafts, drafts fetched "
                        "from the worker in a second round trip)")
    p.add_argument("--lookup-ab", action="store_true",
                   help="with --interleave: also run this checkout's plugin with context lookup off")
    p.add_argument("--history-ab", action="store_true",
                   help="with --interleave: also run this checkout's plugin without the output history "
                        "(lookup chains from each request's own context only)")
    p.add_argument("--corpus-ab", action="store_true",
                   help="with --interleave: also run this checkout's plugin without the lookup corpus "
                        "(heterospec/datastore.py)")
    p.add_argument("--baseline", nargs="+", default=[], metavar="DIR",
                   help="with --interleave: also run the HeteroSpec plugin of each heterospec checkout DIR")
    args = p.parse_args()
    if (args.baseline or args.path_stop_ab or args.never_drafts or args.lean_steps_ab or args.lookup_ab
            or args.history_ab or args.corpus_ab or args.heterospec_k_ab or args.repeats != 1) and not args.interleave:
        p.error("--baseline, --path-stop-ab, --never-drafts, --lean-steps-ab, --lookup-ab, --history-ab, "
                "--corpus-ab, --heterospec-k-ab and --repeats need --interleave")
    if args.heterospec_k in args.heterospec_k_ab:
        p.error("--heterospec-k-ab: K other than --heterospec-k")
    if args.continuous and any(1 < b < max(args.batch) for b in args.batch):
        p.error("--continuous runs the largest batch size continuously; other batch sizes must be 1")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if args.seed is not None and args.temperature == 0:
        p.error("--seed needs --temperature > 0 (greedy decoding has no randomness)")
    args.preload = _preload() if args.ld_preload == "auto" else ""

    from tqdm.auto import tqdm

    from heterospec.bench import machine_description
    from heterospec.datasets import load_prompts

    os.makedirs(args.out, exist_ok=True)
    texts = [pr.text for pr in load_prompts(args.set, n=args.n, seed=0)]
    prompts_file = os.path.join(args.out, "prompts.json")
    with open(prompts_file, "w") as f:
        json.dump(texts, f)
    runs = [("vllm autoregressive", "autoregressive", 0, {}, {})] + \
        [(f"vllm eagle3 K={k}", "eagle3", k, {}, {}) for k in args.ks]
    for base in map(os.path.abspath, args.baseline):
        runs.append((f"vllm heterospec (K<={args.heterospec_k}), {os.path.basename(base)}", "heterospec",
                     args.heterospec_k, {"PYTHONPATH": os.pathsep.join([base, os.environ.get("PYTHONPATH", "")])}, {}))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))    # this checkout's plugin
    env_here = {"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])} if args.interleave else {}
    if args.path_stop_ab:
        runs.append((f"vllm heterospec (K<={args.heterospec_k}), path stop off", "heterospec", args.heterospec_k,
                     env_here, {"path_stop": False}))
    if args.lookup_ab:
        runs.append((f"vllm heterospec (K<={args.heterospec_k}), lookup off", "heterospec", args.heterospec_k,
                     env_here, {"lookup": False}))
    if args.history_ab:
        runs.append((f"vllm heterospec (K<={args.heterospec_k}), history off", "heterospec", args.heterospec_k,
                     env_here, {"history": False}))
    if args.corpus_ab:
        runs.append((f"vllm heterospec (K<={args.heterospec_k}), corpus off", "heterospec", args.heterospec_k,
                     env_here, {"corpus": False}))
    if args.never_drafts:
        runs.append((f"vllm heterospec (K<={args.heterospec_k}), never drafts", "heterospec", args.heterospec_k,
                     env_here, {"costs": _never_drafting_costs(args.out), "learn": False}))
    for k in args.heterospec_k_ab:
        runs.append((f"vllm heterospec (K<={k})", "heterospec", k, env_here, {}))
    main_label = f"vllm heterospec (K<={args.heterospec_k})"
    runs.append((main_label, "heterospec", args.heterospec_k, env_here, {}))
    if args.lean_steps_ab:
        runs += [(label + ", lean steps off", m, k, env, {**opts, "lean_steps": False})
                 for label, m, k, env, opts in runs if m == "heterospec" and env is env_here]
    results = {}
    if args.interleave:
        results = _vllm_interleaved([(lab, m, max(k, 1), env, opts) for lab, m, k, env, opts in runs],
                                    prompts_file, len(texts), args)
    else:
        for label, method, k, _, _ in tqdm(runs, desc="vLLM engines", unit="engine"):
            for b, o in _vllm_run(method, max(k, 1), prompts_file, args).items():
                results[(label, b)] = o
    if not args.no_ours:
        for (m, b), o in _ours(texts, args).items():
            results[(f"ours {m}", b)] = o

    labels = list(dict.fromkeys(lab for lab, _ in results))
    from heterospec.costmodel import _cpu_info
    lines = [f"machine: {machine_description('cpu')}, CPU flags: {' '.join(_cpu_info()['cpu_flags'])}", f"vLLM LD_PRELOAD: {args.preload or 'none'}",
             f"{args.set} first {args.n} prompts, {args.max_new_tokens} new tokens, "
             + ("greedy" if args.temperature == 0 else f"temperature {args.temperature}"
                + (f", seeds {args.seed}.." if args.seed is not None else ", no seeds (texts not compared)"))
             + f", {args.dtype}"
             + ("; vLLM engine cores in-process" if args.in_process else "; vLLM engine cores split (own process)")
             + (f"; vLLM engines interleaved, {args.repeats} pass(es)" if args.interleave else "")
             + (f"; batch {max(args.batch)}: all prompts in one call, {max(args.batch)} running at once (continuous)"
                if args.continuous else ""), "",
             "| system | " + " | ".join(f"batch {b} tok/s | vs vLLM AR" for b in args.batch) + " | same text |",
             "|---|" + "---|---|" * len(args.batch) + "---|"]
    rows = []
    for lab in labels:
        cells, same = [], True
        ref_lab = "ours autoregressive" if lab.startswith("ours") else "vllm autoregressive"
        for b in args.batch:
            o, ar, ref = results[(lab, b)], results[("vllm autoregressive", b)], results[(ref_lab, b)]
            tps, ar_tps = o["tokens"] / o["seconds"], ar["tokens"] / ar["seconds"]
            same = same and o["token_ids"] == ref["token_ids"]
            cells += [f"{tps:.1f}", f"{tps / ar_tps:.2f}x"]
            rows.append({"system": lab, "batch": b, "tokens_per_s": tps, "vs_vllm_ar": tps / ar_tps,
                         "tokens": o["tokens"], "seconds": o["seconds"]})
            if o.get("passes") and ar.get("passes"):     # interleaved: each pass's ratio to vLLM AR's
                rows[-1]["pass_vs_vllm_ar"] = [(t / s) / (at / a_s) for (t, s), (at, a_s) in zip(o["passes"], ar["passes"])]
        if args.temperature > 0 and args.seed is None:
            same = None                       # unseeded sampling: nothing to compare
        lines.append(f"| {lab} | " + " | ".join(cells) + f" | {'n/a' if same is None else 'yes' if same else 'NO'} |")
    accept = [(lab, b, cells) for lab in labels for b in args.batch
              for cells in [acceptance_cells(results[(lab, b)].get("spec") or {})] if cells]
    if accept:        # what the drafts were worth (vLLM's counters; a copied chain counts as a draft)
        lines += ["", "| system | batch | drafts | draft tokens | accepted | by position (given the one before) |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {lab} | {b} | " + " | ".join(cells) + " |" for lab, b, cells in accept]
        for row in rows:                  # (and into the JSON rows)
            if acceptance_cells(results[(row["system"], row["batch"])].get("spec") or {}):
                row["spec"] = results[(row["system"], row["batch"])]["spec"]
    best = {b: max((r for r in rows if r["system"].startswith("vllm eagle3") and r["batch"] == b),
                   key=lambda r: r["tokens_per_s"]) for b in args.batch}
    lines.append("")
    for b in args.batch:
        hs = next(r for r in rows if r["system"] == main_label and r["batch"] == b)
        lines.append(f"batch {b}: vLLM+HeteroSpec / best fixed-K vLLM eagle3 ({best[b]['system']}) = "
                     f"{hs['tokens_per_s'] / best[b]['tokens_per_s']:.2f}x; / vLLM autoregressive = {hs['vs_vllm_ar']:.2f}x")
    report = "\n".join(lines)
    print(report)
    with open(os.path.join(args.out, "vllm_compare.md"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(args.out, "vllm_compare.json"), "w") as f:
        json.dump(rows, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(10, 4.5))
        w = 0.8 / len(args.batch)
        for i, b in enumerate(args.batch):
            vals = [next(r["vs_vllm_ar"] for r in rows if r["system"] == lab and r["batch"] == b) for lab in labels]
            ax.bar([x + i * w for x in range(len(labels))], vals, w, label=f"batch {b}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([x + w * (len(args.batch) - 1) / 2 for x in range(len(labels))], labels, rotation=30, ha="right")
        ax.set_ylabel("tokens/s vs vLLM autoregressive")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "vllm_compare.png"), dpi=110)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
