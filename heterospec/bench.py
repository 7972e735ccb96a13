"""End-to-end benchmark: autoregressive vs EAGLE-3 vs HeteroSpec, side by side in one run.

For every prompt of every set the methods run back to back on the same engine (their order rotates
from prompt to prompt so that no method always runs first), so each speedup is a ratio measured
in one run on one machine. Greedy outputs are compared token for token as a correctness check.
Also: :func:`verify_latency_curve`, how verification latency grows with tree tokens on this device.
"""

from __future__ import annotations

import collections
import datetime
import json
import math
import os
import platform
import re
import statistics
import time
from collections import defaultdict
from typing import Dict, List, Optional, Sequence

import torch

from . import ops
from .models.linear import settled_weights


# What a benchmark compares: the engine's methods, plus HeteroSpec with the paper's formulas and
# HeteroSpec fitted without context lookup (heterospec.lookup).
BENCH_METHODS = ("heterospec", "heterospec-nolookup", "heterospec-nocorpus", "heterospec-paper", "eagle3",
                 "autoregressive")
# Graph engines' warm-up requests (run_e2e): our own text, one of each kind the sets hold (chat,
# code, math, summary), so the timed calls replay graphs instead of capturing them.
WARMUP_PROMPTS = (
    "Write a short, friendly letter inviting a neighbour to a garden party next Saturday.",
    "Write a Python function that merges two sorted lists of integers into one sorted list without calling sort().",
    "A shop sells pencils at 3 for 45 cents. How much do 14 pencils cost? Explain step by step.",
    "Summarise in three sentences why regular exercise helps both the body and the mind.",
)


def _warmup_as_long_as(engine, texts: Sequence[str]) -> str:
    """A warm-up request of our own text with a prompt at least as long as the longest of
    ``texts``. With CUDA graphs the engine keeps its KV caches between calls and a call that
    outgrows them reallocates them and captures every graph again (engine._new_cache); warmed up
    at the longest prompt, the timed calls replay what the warm-up captured, as a server sizes
    its caches for its longest request before serving."""
    longest = max(len(engine._encode(t, chat=True)) for t in texts)
    text = " ".join(WARMUP_PROMPTS)
    while len(engine._encode(text, chat=True)) < longest:
        text += " " + " ".join(WARMUP_PROMPTS)
    return text


def _fit_seconds(engine) -> float:
    """Seconds the engine's fitted policies have spent fitting plans so far (a share of each
    call's policy time: on a GPU's short rounds the refit budget, ``FittedPolicy.FIT_SHARE``,
    may be what the policy costs)."""
    return sum(getattr(p, "_fit_s", 0.0) for p in getattr(engine, "_fitted", {}).values())


def bench_call(label: str) -> dict:
    """The generate() arguments a benchmark label stands for: ``"heterospec-paper"`` ->
    method heterospec, policy paper; ``"heterospec-nolookup"`` -> the fitted policy without
    context lookup; ``"heterospec-nocorpus"`` -> lookups without the lookup corpus (heterospec.datastore);
    other labels run the engine's default."""
    if label == "heterospec-paper":
        return {"method": "heterospec", "policy": "paper"}
    if label == "heterospec-nolookup":
        return {"method": "heterospec", "policy": "fitted", "lookup": False}
    if label == "heterospec-nocorpus":
        return {"method": "heterospec", "policy": "fitted", "lookup": True, "corpus": False}
    if label == "heterospec":
        return {"method": "heterospec", "policy": "fitted", "lookup": True}
    return {"method": label}


def machine_description(device) -> str:
    if getattr(device, "type", str(device)).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def speed_flags(announce: bool = False) -> List[str]:
    """The CPU flags every speed result names (bf16 / AMX support decides the fast paths);
    ``announce``: also print them with the torch thread count."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = sorted(set(re.findall(r"avx512_bf16|avx2|amx_bf16", f.read())))
    except OSError:
        flags = []
    if announce:
        print("CPU flags:", " ".join(flags) or "(none found)", "| torch threads", torch.get_num_threads())
    return flags


def write_report(out_dir: str, stem: str, text: str, payload: dict) -> None:
    """Print ``text`` and write it to ``out_dir/stem.md``, ``payload`` to ``out_dir/stem.json``
    (the A/B scripts of bench/)."""
    print(text)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(payload, f, indent=1)


def _acceptance_rates(records: List[dict], max_len: int) -> List[float]:
    """P(accept_len >= i) for i = 1..max_len: the per-position acceptance rate of the tree."""
    if not records:
        return []
    return [sum(r["accept_len"] >= i for r in records) / len(records) for i in range(1, max_len + 1)]


def summarize(runs: List[dict]) -> Dict[str, Dict[str, dict]]:
    """Aggregate per (set, method): totals, rates and ratios against autoregressive."""
    by = defaultdict(list)
    for r in runs:
        by[(r["set"], r["method"])].append(r)
    out: Dict[str, Dict[str, dict]] = defaultdict(dict)
    for (name, method), rs in by.items():
        tokens = sum(r["new_tokens"] for r in rs)
        total_s = sum(r["total_s"] for r in rs)
        decode_s = sum(r["total_s"] - r["prefill_s"] for r in rs)
        rounds = sum(r["rounds"] for r in rs)
        calls = sum(r["target_calls"] for r in rs)
        verified = sum(r["verified_tokens"] for r in rs)
        recs = [x for r in rs for x in r["records"]]
        out[name][method] = {
            "prompts": len(rs), "new_tokens": tokens, "total_s": total_s,
            "tokens_per_s": tokens / total_s if total_s else float("nan"),
            "decode_tokens_per_s": tokens / decode_s if decode_s else float("nan"),
            "tau": (sum(x["accept_len"] + 1 for x in recs) / len(recs)) if recs else 1.0,
            "target_calls": calls, "verified_tokens": verified,
            "verified_per_call": verified / calls if calls else float("nan"),
            "draft_ms_per_round": 1e3 * sum(r["draft_s"] for r in rs) / rounds if rounds else 0.0,
            "verify_ms_per_call": 1e3 * sum(r["verify_s"] for r in rs) / calls if calls else float("nan"),
            # host time per target call: the policy's, and what is left of the wall time after
            # prefill, draft, verify and policy (commit, token handling, graph input copies)
            "policy_ms_per_call": 1e3 * sum(r.get("policy_s", 0.0) for r in rs) / calls if calls else float("nan"),
            # ... of which refitting plans (the fitted policy's refit budget)
            "fit_ms_per_call": 1e3 * sum(r.get("fit_s", 0.0) for r in rs) / calls if calls else float("nan"),
            "other_ms_per_call": 1e3 * sum(r["total_s"] - r["prefill_s"] - r["draft_s"] - r["verify_s"]
                                           - r.get("policy_s", 0.0) for r in rs) / calls if calls else float("nan"),
            # the prompt's pass (the target's, and the draft's where it runs there): a cost per
            # new prompt shape shows here (cuDNN plans on a GPU, bench/RESULTS.md, sixty-fifth session)
            "prefill_ms_per_prompt": 1e3 * sum(r["prefill_s"] for r in rs) / len(rs),
            "acceptance_rates": _acceptance_rates(recs, max((x["depth"] for x in recs), default=0)),
            # target calls that verified a context-lookup chain (heterospec.lookup)
            "lookup_share": sum(bool(x.get("lookup")) for x in recs) / calls if calls else 0.0,
            # ... of which the chain was copied from an earlier request (lookup.OutputHistory)
            "history_share": sum(bool(x.get("history")) for x in recs) / calls if calls else 0.0,
            "corpus_share": sum(bool(x.get("corpus")) for x in recs) / calls if calls else 0.0,
        }
    for name, ms in out.items():
        ar = ms.get("autoregressive")
        for method, m in ms.items():
            m["speedup"] = m["tokens_per_s"] / ar["tokens_per_s"] if ar else float("nan")
            e3 = ms.get("eagle3")
            m["vs_eagle3"] = m["tokens_per_s"] / e3["tokens_per_s"] if e3 else float("nan")
    return out


def _ratio(x: float, digits: int) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}x"   # nan: the reference method was not run


# Paired intervals of speedups (paired_ratio_interval): their level, the resamples drawn and the
# fewest paired units one is given for (below that a bootstrap says little).
RATIO_LEVEL = 0.9
RATIO_DRAWS = 2000
RATIO_MIN_GROUPS = 4


def paired_ratio_interval(units: Sequence[dict], method: str, ref: str = "autoregressive",
                          level: float = RATIO_LEVEL, draws: int = RATIO_DRAWS, seed: int = 0,
                          stratum: Optional[str] = None) -> Optional[List[float]]:
    """A bootstrap interval (``level``, percentile) of ``method``'s tokens/s over ``ref``'s, from
    paired units: each holds the ``tokens`` and ``wall_s`` of every method on the same prompts at
    the same moment of the machine (``batch_sweep``'s call groups; one prompt of ``run_e2e``). A
    resample draws units with replacement and takes the ratio of the pooled rates, so a slow
    moment that slowed both methods of a unit moves neither side more than the other. With
    ``stratum`` (a key of the units, e.g. the prompt set) units are drawn within their stratum
    and the statistic is the mean of the strata's ratios (the five sets' mean speedup). None with
    fewer than ``RATIO_MIN_GROUPS`` units holding both methods, or a stratum with fewer than two
    (seeded: the same units give the same interval)."""
    import random

    strata: Dict[object, list] = defaultdict(list)
    for u in units:
        if method in u["tokens"] and ref in u["tokens"]:
            strata[u.get(stratum) if stratum else None].append(
                (u["tokens"][method], u["wall_s"][method], u["tokens"][ref], u["wall_s"][ref]))
    groups = list(strata.values())
    if method == ref or sum(map(len, groups)) < RATIO_MIN_GROUPS or any(len(g) < 2 for g in groups):
        return None
    rng, stats = random.Random(seed), []
    for _ in range(draws):
        ratios = []
        for pairs in groups:
            tm = wm = tr = wr = 0.0
            for _ in range(len(pairs)):
                a, b, c, d = pairs[rng.randrange(len(pairs))]
                tm, wm, tr, wr = tm + a, wm + b, tr + c, wr + d
            if wm > 0 and tr > 0:
                ratios.append((tm / wm) / (tr / wr))
        if len(ratios) == len(groups):
            stats.append(sum(ratios) / len(ratios))
    if not stats:
        return None
    stats.sort()
    return [stats[int((1 - level) / 2 * (len(stats) - 1))], stats[int(round((1 + level) / 2 * (len(stats) - 1)))]]


def mean_intervals(runs: List[dict], methods: Sequence[str]) -> Dict[str, Dict[str, Optional[List[float]]]]:
    """Per method, bootstrap intervals (:func:`paired_ratio_interval`, prompts drawn within their
    set) of the mean over the sets of its speedup over autoregressive and its ratio to eagle3:
    every prompt is a paired unit, all methods having decoded it one after the other."""
    units: Dict[tuple, dict] = {}
    for r in runs:
        u = units.setdefault((r["set"], r["prompt_id"]), {"set": r["set"], "tokens": {}, "wall_s": {}})
        u["tokens"][r["method"]], u["wall_s"][r["method"]] = r["new_tokens"], r["total_s"]
    return {m: {"speedup": paired_ratio_interval(list(units.values()), m, "autoregressive", stratum="set"),
                "vs_eagle3": paired_ratio_interval(list(units.values()), m, "eagle3", stratum="set")}
            for m in methods}


def _interval(ci: Optional[List[float]], digits: int) -> str:
    return f" ({ci[0]:.{digits}f}-{ci[1]:.{digits}f})" if ci else ""


def markdown_table(summary: Dict[str, Dict[str, dict]], methods: Sequence[str],
                   intervals: Optional[Dict[str, Dict[str, Optional[List[float]]]]] = None) -> str:
    """The per-set table, and a mean row per method (with ``intervals``, from
    :func:`mean_intervals`: the mean ratios' bootstrap intervals)."""
    head = ("| set | method | tok/s | speedup vs AR | vs eagle3 | tau | target calls | verified/call "
            "| draft ms/round | verify ms/call | policy ms/call (fits) | other ms/call | prefill ms/prompt "
            "| lookup calls (history, corpus) |")
    lines = [head, "|" + "---|" * 14]
    means = defaultdict(lambda: defaultdict(list))
    for name, ms in summary.items():
        for method in methods:
            if method not in ms:
                continue
            m = ms[method]
            lines.append(f"| {name} | {method} | {m['tokens_per_s']:.2f} | {_ratio(m['speedup'], 2)} | {_ratio(m['vs_eagle3'], 3)} "
                         f"| {m['tau']:.2f} | {m['target_calls']} | {m['verified_per_call']:.1f} "
                         f"| {m['draft_ms_per_round']:.1f} | {m['verify_ms_per_call']:.1f} "
                         f"| {m.get('policy_ms_per_call', float('nan')):.2f} ({m.get('fit_ms_per_call', 0.0):.2f}) "
                         f"| {m.get('other_ms_per_call', float('nan')):.2f} "
                         f"| {m.get('prefill_ms_per_prompt', float('nan')):.1f} "
                         f"| {100 * m.get('lookup_share', 0.0):.0f} % ({100 * m.get('history_share', 0.0):.0f} %, "
                         f"{100 * m.get('corpus_share', 0.0):.0f} %) |")
            for key in ("speedup", "vs_eagle3", "tau", "verified_per_call"):
                means[method][key].append(m[key])
    for method in methods:
        if method in means:
            mm = {k: statistics.fmean(v) for k, v in means[method].items()}
            ci = (intervals or {}).get(method, {})
            lines.append(f"| **mean** | {method} | | {_ratio(mm['speedup'], 2)}{_interval(ci.get('speedup'), 2)} "
                         f"| {_ratio(mm['vs_eagle3'], 3)}{_interval(ci.get('vs_eagle3'), 3)} | {mm['tau']:.2f} "
                         f"| | {mm['verified_per_call']:.1f} | | | | | | |")
    if any(v for ci in (intervals or {}).values() for v in ci.values()):
        lines.append(f"\n(a-b after a mean: its {RATIO_LEVEL:.0%} bootstrap interval, prompts drawn within their set)")
    return "\n".join(lines)


def plot(summary, runs, out_dir: str) -> List[str]:
    """Speedup per set, and for HeteroSpec the entropy-bin histogram and acceptance per bin."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    sets = list(summary)
    methods = [m for m in BENCH_METHODS[::-1] if any(m in summary[s] for s in sets)]
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        ax.bar([j + i * w for j in range(len(sets))], [summary[s].get(m, {}).get("speedup", 0) for s in sets],
               width=w, label=m)
    ax.set_xticks([j + w * (len(methods) - 1) / 2 for j in range(len(sets))], sets)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("speedup vs autoregressive")
    ax.legend()
    ax.set_title("End-to-end speedup (same engine, same prompts, one run)")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "speedup.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    recs = [x for r in runs if r["method"] == "heterospec" for x in r["records"]]
    if recs:
        nb = max(x["bin"] for x in recs) + 1
        counts = [sum(x["bin"] == b for x in recs) for b in range(nb)]
        acc = [statistics.fmean([x["accept_len"] + 1 for x in recs if x["bin"] == b]) if counts[b] else 0
               for b in range(nb)]
        verified = [statistics.fmean([x["verified"] for x in recs if x["bin"] == b]) if counts[b] else 0
                    for b in range(nb)]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        a1.bar(range(nb), counts)
        a1.set_xlabel("entropy bin (0 = lowest H(P*))")
        a1.set_ylabel("rounds")
        a1.set_title("HeteroSpec rounds per entropy bin")
        a2.bar(range(nb), acc, label="tokens per round (tau)")
        a2.plot(range(nb), verified, "o-", color="C3", label="verified nodes")
        a2.set_xlabel("entropy bin")
        a2.set_title("Acceptance length and verified nodes per bin")
        a2.legend()
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "entropy_bins.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def load_prompt_sets(sets: Sequence[str], n: int, seed: int = 0) -> Dict[str, list]:
    """The first ``n`` prompts of each named set; a set without prompts is an error."""
    from .datasets import load_prompts

    prompt_sets = {name: load_prompts(name, n=n, seed=seed) for name in sets}
    empty = [name for name, p in prompt_sets.items() if not p]
    if empty:
        raise ValueError(f"run_e2e: no prompts in set(s) {empty}")
    return prompt_sets


def _graph_totals(runs) -> dict:
    """Per method, the CUDA-graph events of its timed runs (first eager runs, captures, replays)."""
    out = collections.defaultdict(collections.Counter)
    for r in runs:
        out[r["method"]].update(r.get("graphs") or {})
    return {m: dict(c) for m, c in out.items() if c}


def run_e2e(engine, sets: Sequence[str], n: int = 8, max_new_tokens: int = 128, out_dir: str = "bench/out",
            methods: Sequence[str] = ("autoregressive", "eagle3", "heterospec"), seed: int = 0,
            progress: bool = True, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Run every method on every prompt, interleaved; write JSON, Markdown and plots to ``out_dir``.

    ``sets``: prompt-set names, or the dict :func:`load_prompt_sets` returned for them (the CLI
    loads them before the models, so that missing data is reported first).
    ``temperature`` > 0 samples (with ``top_p``): every method samples a prompt with the same seed
    (``seed`` + the prompt's index in the run), so with keyed draws (heterospec.sampling) each
    method's text must be autoregressive sampling's, and it is checked as greedy text is."""
    from tqdm.auto import tqdm

    from .config import SamplingParams

    for name, v in (("n", n), ("max_new_tokens", max_new_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"run_e2e: {name} must be an integer >= 1, got {v!r}")
    sampling = SamplingParams(temperature, top_p, 0, None)      # checks the values
    unknown = [m for m in methods if m not in BENCH_METHODS]
    if unknown:
        raise ValueError(f"run_e2e: unknown methods {unknown}; choose from {', '.join(BENCH_METHODS)}")
    methods = [m for m in BENCH_METHODS if m in methods]
    if not methods or not sets:
        raise ValueError(f"run_e2e: need at least one method and one prompt set, "
                         f"got {list(methods)} and {list(sets)}")
    prompt_sets = dict(sets) if isinstance(sets, dict) else load_prompt_sets(sets, n, seed)
    os.makedirs(out_dir, exist_ok=True)
    # Warm up every code path once so that first-call costs are not charged to one method. With
    # CUDA graphs a configuration runs eagerly once and is captured the second time (0.05-0.1 s
    # each on an H200, 30x a replayed round), and a plan meets most of its configurations (the
    # deeper graph per bin depth, the verify graph per budget) only over several requests: graph
    # engines warm up on WARMUP_PROMPTS (none of them a timed prompt) at the timed length, as a
    # server captures its graphs before its first requests. An engine without a tokenizer takes
    # token ids only: its first prompt.
    graphs = getattr(engine, "round_graphs", None) is not None
    texts = graphs and getattr(engine, "tokenizer", None) is not None
    warm = list(WARMUP_PROMPTS) if texts else [next(iter(prompt_sets.values()))[0].text]
    if texts:
        warm += [_warmup_as_long_as(engine, [p.text for ps in prompt_sets.values() for p in ps])]
    warm_tokens = max_new_tokens if graphs else 8
    for m in methods:
        for w in warm:
            engine.generate(w, max_new_tokens=warm_tokens, **bench_call(m))
    runs, mismatches = [], []
    total = sum(len(p) for p in prompt_sets.values()) * len(methods)
    bar = tqdm(total=total, desc="bench", disable=not progress, unit="gen")
    k = 0
    for name, prompts in prompt_sets.items():
        for i, prompt in enumerate(prompts):
            order = methods[i % len(methods):] + methods[:i % len(methods)]
            call = ({} if sampling.greedy else
                    {"temperature": sampling.temperature, "top_p": sampling.top_p, "seed": seed + k})
            k += 1
            outputs = {}
            for m in order:
                graphs = getattr(engine, "round_graphs", None)
                before = collections.Counter(graphs.counts) if graphs is not None else None
                fit_before = _fit_seconds(engine)
                t0 = time.perf_counter()
                try:
                    res = engine.generate(prompt.text, max_new_tokens=max_new_tokens, **bench_call(m), **call)
                except Exception as exc:   # name the run: a GPU fault is otherwise one anonymous line
                    raise RuntimeError(f"run_e2e: {m} on {name} prompt {prompt.id} (#{i}) failed after "
                                       f"{len(runs)} runs: {exc}") from exc
                wall = time.perf_counter() - t0
                d = res.stats.to_dict()
                d.update(set=name, prompt_id=prompt.id, wall_s=wall, finish=res.finish_reason, method=m,
                         fit_s=_fit_seconds(engine) - fit_before)
                if before is not None:   # CUDA graphs this run captured / replayed (captures are one-off costs)
                    d["graphs"] = dict(graphs.counts - before)
                runs.append(d)
                outputs[m] = res.token_ids
                bar.update(1)
                bar.set_postfix(set=name, method=m, tau=f"{res.stats.tau:.2f}")
            ref = outputs.get("autoregressive")
            for m, toks in outputs.items():
                if ref is not None and toks != ref:
                    where = (first_divergence(engine, engine._encode(prompt.text, True), ref, toks) if sampling.greedy
                             else {"diverge_at": _divergence_index(ref, toks), "sampled": True})
                    mismatches.append({"set": name, "prompt_id": prompt.id, "method": m, **where})
    bar.close()
    summary = summarize(runs)
    meta = {
        "machine": machine_description(engine.device), "device": str(engine.device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": engine.config.to_dict(),
        "bins": engine.bins.to_dict() if "heterospec-paper" in methods else None,
        "fitted_plan": (engine._policy("heterospec", engine.config, "fitted").plan(1).to_dict()
                        if "heterospec" in methods else None),
        "prompts_per_set": n, "max_new_tokens": max_new_tokens, "seed": seed, "methods": methods,
        "temperature": sampling.temperature, "top_p": sampling.top_p,
        "greedy_mismatches": mismatches,
        "dtype": str(next(engine.target.parameters()).dtype),
        "graphs_in_timed_runs": _graph_totals(runs) or None,
    }
    meta["mean_intervals"] = mean_intervals(runs, methods)
    table = markdown_table(summary, methods, meta["mean_intervals"])
    # with no autoregressive run there is nothing to compare against: say so rather than "0"
    checked = (mismatch_summary(mismatches, meta["dtype"]) if "autoregressive" in methods
               else "not checked (autoregressive not run)")
    decoding, what = (("greedy", "Greedy") if sampling.greedy else
                      (f"sampled (temperature {sampling.temperature:g}, top-p {sampling.top_p:g}, seed {seed} + "
                       "the prompt's index, the same for every method)", "Sampled"))
    with open(os.path.join(out_dir, "e2e.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "runs": runs}, f, indent=1)
    with open(os.path.join(out_dir, "e2e.md"), "w") as f:
        f.write(f"Machine: {meta['machine']}; device {meta['device']}, {meta['dtype']}; {meta['date']}\n\n")
        f.write(f"Tree: {meta['config']}; {n} prompts per set, max_new_tokens={max_new_tokens}, {decoding}\n\n")
        f.write(table + "\n")
        f.write(f"\n{what} outputs differing from autoregressive: {checked}\n")
        if meta["graphs_in_timed_runs"]:
            f.write(f"\nCUDA graphs in the timed runs, per method: {meta['graphs_in_timed_runs']}\n")
    paths = plot(summary, runs, out_dir)
    print(table)
    print(f"{what.lower()} mismatches vs autoregressive: {checked}")
    print("wrote", ", ".join([os.path.join(out_dir, "e2e.json"), os.path.join(out_dir, "e2e.md")] + paths))
    return {"meta": meta, "summary": summary, "runs": runs}


# A divergence whose top-2 logit gap is at most this many units in the last place of the top
# logit (in the model's dtype) is a rounding tie: the tree pass (many tokens per forward) and the
# one-token pass round differently in bf16/fp16, and such a gap is within that noise.
TIE_ULPS = 8


def _divergence_index(ref: List[int], out: List[int]) -> int:
    """The first position where ``out`` leaves ``ref`` (the shorter length if one is a prefix)."""
    return next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))


def first_divergence(engine, prompt_ids: List[int], ref: List[int], out: List[int]) -> dict:
    """Where ``out`` leaves the autoregressive output ``ref``, and how close the target's choice
    was there: its top-1 minus top-2 logit after ``prompt + ref[:i]`` (one prefill-shaped forward,
    the model's own dtype), also in units in the last place of the top logit."""
    i = _divergence_index(ref, out)
    seq = list(prompt_ids) + list(ref[:i])
    t, dev = engine.target, engine.device
    with torch.inference_mode():
        logits, _ = t(torch.tensor([seq], device=dev), torch.arange(len(seq), device=dev)[None],
                      t.new_cache(1, len(seq)), torch.zeros(1, dtype=torch.long, device=dev),
                      return_features=False, logits_index=torch.tensor([[len(seq) - 1]], device=dev))
    top = logits[0, 0].float().topk(2).values
    margin = float(top[0] - top[1])
    ulp = torch.finfo(t.dtype).eps * 2.0 ** math.floor(math.log2(max(abs(float(top[0])), 1e-30)))
    return {"diverge_at": i, "top2_margin": margin, "margin_ulps": margin / ulp}


def mismatch_summary(mismatches: List[dict], dtype: str) -> str:
    """One line: how many greedy outputs differ, and whether every one is a rounding tie (sampled
    outputs differ only where a tree row and a one-token row of a half-precision target round
    differently and a keyed uniform falls in between: no tie analysis, the count and positions)."""
    if not mismatches:
        return "0"
    if any(m.get("sampled") for m in mismatches):
        return (f"{len(mismatches)} sampled outputs (first divergences at tokens "
                f"{sorted(m['diverge_at'] for m in mismatches)[:8]}; {dtype})")
    ties = [m for m in mismatches if m["margin_ulps"] <= TIE_ULPS]
    worst = max(m["margin_ulps"] for m in mismatches)
    if "float32" in dtype or "float64" in dtype or len(ties) < len(mismatches):
        return (f"{len(mismatches)} ({len(mismatches) - len(ties)} NOT at a rounding tie; largest top-2 gap at "
                f"the divergence {worst:.1f} ulps; {dtype})")
    return (f"{len(mismatches)}, every one at a rounding tie of {dtype} (the target's top-2 logit gap at the "
            f"divergence is <= {worst:.1f} ulps of the top logit; tie threshold {TIE_ULPS})")


def verify_latency_curve(engine, sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), context: int = 256,
                         repeats: int = 5, out_dir: Optional[str] = "bench/out") -> dict:
    """Median latency of one target forward over a ``T``-token tree after ``context`` tokens."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(sizes)

    def bad(v):
        return isinstance(v, bool) or not isinstance(v, int) or v < 1
    if not sizes or any(bad(v) for v in sizes):
        raise ValueError(f"verify_latency_curve: sizes must be integers >= 1, got {sizes}")
    for name, v in (("context", context), ("repeats", repeats)):
        if bad(v):
            raise ValueError(f"verify_latency_curve: {name} must be an integer >= 1, got {v!r}")
    limit = getattr(engine, "max_length", None)
    if limit is not None and context + max(sizes) > limit:
        raise ValueError(f"verify_latency_curve: context {context} + largest size {max(sizes)} = "
                         f"{context + max(sizes)} exceeds the target's max length {limit}")
    target, dev = engine.target, engine.device
    gen = torch.Generator(device="cpu").manual_seed(0)
    vocab = target.config.vocab_size
    cache = target.new_cache(1, context + max(sizes) + 1)
    lens = torch.zeros(1, dtype=torch.int64, device=dev)
    with torch.inference_mode(), settled_weights():   # as in an engine call
        prompt = torch.randint(0, vocab, (1, context), generator=gen).to(dev)
        target(prompt, torch.arange(context, device=dev)[None], cache, lens, None, None, return_features=False)
        prefix = torch.full((1,), context, dtype=torch.int64, device=dev)
        times = {}
        for T in sizes:
            # A chain-plus-branches tree of T nodes: the shape only changes the mask, not the cost.
            parents = torch.tensor([[-1] + [max(0, (i - 1) // 2) for i in range(1, T)]], device=dev)
            num = torch.tensor([T], device=dev)
            mask, pos, _, _ = ops.build_tree(parents, num, prefix)
            toks = torch.randint(0, vocab, (1, T), generator=gen).to(dev)
            samples = []
            for _ in range(repeats + 1):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                target(toks, pos, cache, prefix, mask, num, return_features=True)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                samples.append(time.perf_counter() - t0)
            times[T] = statistics.median(samples[1:])
    base = times.get(1) or times[min(times)]
    result = {"machine": machine_description(dev), "context": context, "dtype": str(next(target.parameters()).dtype),
              "latency_ms": {T: 1e3 * t for T, t in times.items()},
              "ratio_to_one_token": {T: t / base for T, t in times.items()}}
    for T in sizes:
        print(f"T={T:4d}  {1e3 * times[T]:8.1f} ms  {times[T] / base:5.2f}x one-token step")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "verify_curve.json"), "w") as f:
            json.dump(result, f, indent=1)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(list(times), [1e3 * t for t in times.values()], "o-")
        ax.set_xlabel("tree tokens verified in one forward")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"Verification latency, context {context}\n{result['machine'][:60]}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "verify_curve.png"), dpi=120)
        plt.close(fig)
        print("wrote", os.path.join(out_dir, "verify_curve.json"), os.path.join(out_dir, "verify_curve.png"))
    return result


def batch_sweep(engine, prompts: Sequence[str], batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
                methods: Sequence[str] = BENCH_METHODS, max_new_tokens: int = 64, out_dir: Optional[str] = "bench/out",
                progress: bool = True, repeats: int = 1, prompts_per_size: Optional[int] = None) -> dict:
    """Tokens/s of each method through :meth:`Engine.generate_batch` at each batch size (the first
    ``B`` prompts), methods interleaved per batch size; greedy outputs checked against
    autoregressive. Writes ``batch_sweep.json`` and a plot of tokens/s vs batch size, and a plot
    of the fitted policy's action per bin at each batch size.

    ``repeats``: the whole sweep runs that many times (interleaved); a row then reports the
    median tokens/s of its calls and, as ``vs_autoregressive``, the median of its per-repeat
    ratios to the autoregressive call of the same repeat (on a shared machine one call's time
    moves by 10 % or more; the paired median is what the goals can be judged on). ``calls``
    keeps every call (with ``prompts_per_size``: every call group's sums), ``call_groups`` each
    group of prompts' tokens and seconds per method, and ``vs_autoregressive_interval`` says how
    far a row's ratio can be trusted: a bootstrap interval over those paired groups
    (:func:`paired_ratio_interval`; None with fewer than ``RATIO_MIN_GROUPS``), drawn in the
    plot's second panel.

    ``prompts_per_size``: every batch size decodes the same first ``W`` prompts, in ``W / B``
    calls of ``B`` (each batch size must divide ``W``), the methods taking turns call by call;
    a row then sums its calls. By default batch size ``B`` is one call over the first ``B``
    prompts, so batch 1 rests on one prompt: one prompt's luck (a copied chain, a run of easy
    text) and one moment's speed of the machine decide that column."""
    from tqdm.auto import tqdm

    unknown = [m for m in methods if m not in BENCH_METHODS]
    if unknown:
        raise ValueError(f"batch_sweep: unknown methods {unknown}; choose from {', '.join(BENCH_METHODS)}")
    if not batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sweep: batch sizes must be integers >= 1, got {list(batch_sizes)}")
    if prompts_per_size is not None:
        if isinstance(prompts_per_size, bool) or not isinstance(prompts_per_size, int) or prompts_per_size < 1:
            raise ValueError(f"batch_sweep: prompts_per_size must be an integer >= 1, got {prompts_per_size!r}")
        uneven = [b for b in batch_sizes if prompts_per_size % b]
        if uneven:
            raise ValueError(f"batch_sweep: prompts_per_size={prompts_per_size} is not a multiple of batch "
                             f"size(s) {uneven}: every batch size decodes the same prompts in full calls")
    need = prompts_per_size or max(batch_sizes)
    if len(prompts) < need:
        raise ValueError(f"batch_sweep: {len(prompts)} prompts for "
                         + (f"prompts_per_size={need}" if prompts_per_size else f"a batch of {need}"))
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"batch_sweep: repeats must be an integer >= 1, got {repeats!r}")
    methods = [m for m in BENCH_METHODS if m in methods]
    # Warm-up: every method once (its code paths), then once at the largest batch size and the
    # timed length. The first call of a process at a batch size larger than any before pays a
    # one-off (its caches' memory, first touched), 0.2-0.5 s at batch 16 on the 2-core box,
    # charged to whichever method ran first there: batch 16 read 0.915x in one repeat and 1.008x
    # in the other (bench/RESULTS.md, sixty-fifth session).
    for m in methods:
        engine.generate_batch(prompts[:1], max_new_tokens=8, **bench_call(m))
    for m in methods:
        engine.generate_batch(prompts[:max(batch_sizes)], max_new_tokens=max_new_tokens, **bench_call(m))

    def groups(B: int) -> List[List[int]]:
        return ([list(range(start, start + B)) for start in range(0, prompts_per_size, B)]
                if prompts_per_size else [list(range(B))])

    calls, divergences, units = [], [], []
    bar = tqdm(total=repeats * sum(len(groups(B)) for B in batch_sizes) * len(methods), desc="batch sweep",
               disable=not progress, unit="call")
    for rep in range(repeats):
        for i, B in enumerate(batch_sizes):
            sums = {m: {"tokens": 0, "wall_s": 0.0, "recs": []} for m in methods}
            for g, idx in enumerate(groups(B)):
                turn = (i + rep + g) % len(methods)
                outs = {}
                unit = {"repeat": rep, "batch_size": B, "group": g, "tokens": {}, "wall_s": {}}
                for m in methods[turn:] + methods[:turn]:
                    t0 = time.perf_counter()
                    res = engine.generate_batch([prompts[j] for j in idx], max_new_tokens=max_new_tokens,
                                                **bench_call(m))
                    unit["wall_s"][m] = time.perf_counter() - t0
                    unit["tokens"][m] = sum(len(r.token_ids) for r in res)
                    sums[m]["wall_s"] += unit["wall_s"][m]
                    sums[m]["tokens"] += unit["tokens"][m]
                    sums[m]["recs"] += [r for x in res for r in x.stats.records]
                    outs[m] = [r.token_ids for r in res]
                    bar.update(1)
                units.append(unit)
                ref = outs.get("autoregressive")
                for m, out in (outs.items() if ref is not None else ()):
                    for j, o, a in zip(idx, out, ref):
                        if o != a:   # (after the timed calls) where it parted, and how close the target's choice was
                            divergences.append({"repeat": rep, "batch_size": B, "prompt": j, "method": m,
                                                **first_divergence(engine, engine._encode(prompts[j], True), a, o)})
            for m in methods:
                toks, wall, recs = sums[m]["tokens"], sums[m]["wall_s"], sums[m]["recs"]
                calls.append({"repeat": rep, "batch_size": B, "method": m, "tokens": toks, "wall_s": wall,
                              "tokens_per_s": toks / wall, "calls": len(groups(B)),
                              "tau": sum(r.accept_len + 1 for r in recs) / len(recs) if recs else 1.0,
                              "plain_rounds": sum(r.plain for r in recs), "lookup_rounds": sum(r.lookup for r in recs),
                              "rounds": len(recs)})
    bar.close()
    ar_of = {(c["repeat"], c["batch_size"]): c for c in calls if c["method"] == "autoregressive"}
    rows = []
    for B in batch_sizes:
        for m in methods:
            mine = [c for c in calls if c["method"] == m and c["batch_size"] == B]
            ratios = [c["tokens_per_s"] / ar_of[(c["repeat"], B)]["tokens_per_s"]
                      for c in mine if (c["repeat"], B) in ar_of]
            rows.append({"batch_size": B, "method": m, "repeats": len(mine),
                         "tokens": mine[0]["tokens"], "wall_s": statistics.median(c["wall_s"] for c in mine),
                         "tokens_per_s": statistics.median(c["tokens_per_s"] for c in mine),
                         "tau": statistics.mean(c["tau"] for c in mine),
                         "plain_rounds": sum(c["plain_rounds"] for c in mine),
                         "lookup_rounds": sum(c.get("lookup_rounds", 0) for c in mine),
                         "rounds": sum(c["rounds"] for c in mine),
                         "vs_autoregressive": statistics.median(ratios) if ratios else None,
                         "vs_autoregressive_interval": paired_ratio_interval(
                             [u for u in units if u["batch_size"] == B], m)})
    by = {(r["method"], r["batch_size"]): r for r in rows}
    plans = {}
    if "heterospec" in methods:
        pol = engine._policy("heterospec", engine.config, "fitted")
        plans = {B: pol.plan(B).to_dict() for B in batch_sizes}
    result = {"machine": machine_description(engine.device), "dtype": str(engine.target.lm_head.weight.dtype),
              "max_new_tokens": max_new_tokens, "repeats": repeats, "prompts_per_size": prompts_per_size,
              "rows": rows, "calls": calls, "call_groups": units,
              "greedy_mismatches": len(divergences), "greedy_divergences": divergences, "plans": plans}
    def cell(r: dict) -> str:
        text = f"{r['tokens_per_s']:.1f}"
        if r["vs_autoregressive"] and r["method"] != "autoregressive":
            ci = r["vs_autoregressive_interval"]
            text += f" ({r['vs_autoregressive']:.2f}x" + (f"; {ci[0]:.2f}-{ci[1]:.2f}" if ci else "") + ")"
        elif r["vs_autoregressive"]:
            text += f" ({r['vs_autoregressive']:.2f}x)"
        return text

    lines = ["| batch | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for B in batch_sizes:
        lines.append(f"| {B} | " + " | ".join(cell(by[(m, B)]) for m in methods) + " |")
    table = "\n".join(lines)
    if any(r["vs_autoregressive_interval"] for r in rows):
        table += (f"\n\n(a-b: {RATIO_LEVEL:.0%} bootstrap interval of the ratio to autoregressive over the paired "
                  f"call groups of all repeats)")
    print(table)
    print(f"greedy outputs differing from autoregressive: {mismatch_summary(divergences, result['dtype'])}")
    if out_dir:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "batch_sweep.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(out_dir, "batch_sweep.md"), "w") as f:
            f.write(f"Machine: {result['machine']}; {result['dtype']}; max_new_tokens={max_new_tokens}; "
                    + (f"every batch size: the same {prompts_per_size} prompts" if prompts_per_size
                       else "batch size B: the first B prompts") + f"; {repeats} repeat(s)\n\n")
            f.write(table + "\n")
        fig, (ax, rx) = plt.subplots(1, 2, figsize=(10, 4))
        for m in methods:
            ax.plot(batch_sizes, [by[(m, B)]["tokens_per_s"] for B in batch_sizes], "o-", label=m)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"generate_batch throughput\n{result['machine'][:60]}", fontsize=9)
        ax.legend()
        # the ratios to autoregressive, with their paired intervals where there are enough groups
        for m in (m for m in methods if m != "autoregressive"):
            rs = [by[(m, B)] for B in batch_sizes]
            ys = [r["vs_autoregressive"] or float("nan") for r in rs]
            err = [[y - (r["vs_autoregressive_interval"] or [y, y])[0] for y, r in zip(ys, rs)],
                   [(r["vs_autoregressive_interval"] or [y, y])[1] - y for y, r in zip(ys, rs)]]
            rx.errorbar(batch_sizes, ys, yerr=err, fmt="o-", capsize=3, label=m)
        rx.axhline(1.0, color="k", lw=0.8)
        rx.set_ylabel("tokens/s over autoregressive")
        rx.set_title(f"paired ratios ({RATIO_LEVEL:.0%} bootstrap intervals over call groups)", fontsize=9)
        if len(methods) > 1:
            rx.legend(fontsize=7)
        for a in (ax, rx):
            a.set_xscale("log", base=2)
            a.set_xlabel("batch size (requests)")
            a.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "batch_sweep.png"), dpi=120)
        plt.close(fig)
        if plans:
            fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
            for B, p in plans.items():
                if p["speculate"]:
                    axes[0].plot(range(len(p["depth"])), p["depth"], "o-", label=f"B={B}")
                    axes[1].plot(range(len(p["budget"])), [n + 1 for n in p["budget"]], "o-", label=f"B={B}")
            axes[0].set_title("draft forwards per bin")
            axes[1].set_title("verified nodes per bin")
            for a in axes:
                a.set_xlabel("entropy bin (0 = lowest)")
                a.grid(alpha=0.3)
            off = [B for B, p in plans.items() if not p["speculate"]]
            if off:
                fig.suptitle(f"fitted policy (plain decoding at batch {off})", fontsize=9)
            if any(p["speculate"] for p in plans.values()):
                axes[1].legend(fontsize=7)
            else:                       # nothing to draw: say so instead of an empty legend
                for a in axes:
                    a.text(0.5, 0.5, "no batch size speculates", ha="center", va="center", transform=a.transAxes)
            fig.tight_layout()
            fig.savefig(os.path.join(out_dir, "policy_actions.png"), dpi=120)
            plt.close(fig)
        print("wrote", os.path.join(out_dir, "batch_sweep.json"), os.path.join(out_dir, "batch_sweep.png"))
    return result
