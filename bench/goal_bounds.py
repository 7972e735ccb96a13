"""What acceptance a draft needs on this device: the best chain speedup over plain decoding, from
the device's measured cost curves, as a function of the draft's acceptance per position.

A chain of L draft tokens, each accepted with probability ``a`` given the ones before it, yields
``1 + a + a^2 + ... + a^L`` tokens a round (the bonus token included) and costs the draft's round
(its catch-up over the last round's tokens and L - 1 forwards after it) plus the target's
verification of L + 1 nodes. Against a plain step, the round pays where

    speedup(a, L) = (1 + a + ... + a^L) * plain_ms / (draft_ms(L - 1 forwards) + verify_ms(L + 1))

exceeds 1. The best L per ``a`` bounds what speculation with that draft can reach at batch 1 on
the device the curves were measured on (a chain; a tree spends verified nodes on alternatives,
which pays where extra nodes are cheap: bfloat16 on a CPU with native bf16, a GPU). The draft's
forward is priced as the cost model measured it, a tree forward of ``tree_top_k`` rows, so a
chain's price is an upper bound; the host's Python between forwards is not in the curves.

Also: the same bound for the draft's chain acceptance on the calibration prompts (the shipped
chain tables), and for a free draft (context lookup, the corpus: no draft forward at all).

    python bench/goal_bounds.py --out bench/results/<machine>/goal-bounds
    python bench/goal_bounds.py --costs ~/.cache/heterospec/costs/cpu-float32-<key>.json ...

Default ``--costs``: every cost model cached on this machine (``heterospec calibrate`` or the
engine's first run writes them). Writes goal_bounds.json, goal_bounds.md and goal_bounds.png.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from typing import Dict, List, Optional, Sequence

from heterospec.costmodel import CostModel

DEFAULT_TABLES = os.path.join(os.path.dirname(__file__), "..", "heterospec", "assets", "smollm2-135m-instruct-eagle3",
                              "acceptance_tables_chain.json")
MAX_CHAIN = 8


def chain_tokens(a: float, L: int) -> float:
    """Expected tokens of a round whose chain of L drafts is accepted position by position with
    probability ``a`` (the bonus token included)."""
    return sum(a ** j for j in range(L + 1))


def round_speedup(cm: CostModel, tokens: float, L: int, draft: bool = True, context: int = 256) -> float:
    """A round's tokens per ms over a plain step's (batch 1). ``draft`` False: a free chain."""
    cost = cm.verify_ms(1, L + 1, context)
    if draft:
        cost += cm.draft_ms(1, max(L - 1, 0), extend_tokens=tokens)
    return tokens * cm.plain_ms(1, context) / cost


def best_over_chains(cm: CostModel, a: float, draft: bool = True) -> tuple:
    """(speedup, L) of the best chain length for per-position acceptance ``a``; (1.0, 0) where no
    chain beats plain steps."""
    best = (1.0, 0)
    for L in range(1, MAX_CHAIN + 1):
        s = round_speedup(cm, chain_tokens(a, L), L, draft)
        if s > best[0]:
            best = (s, L)
    return best


def table_chain_tokens(path: str) -> List[float]:
    """Mean tokens of a round (bonus included) per chain length 1..8 over every calibration round
    of the shipped chain tables (all bins, weighted by their rounds)."""
    with open(path) as f:
        tables = json.load(f)
    opt = tables["options"][0]
    counts, accept = opt["counts"], opt["accept"]
    total = float(sum(counts))
    depths, nodes = tables["depths"], tables["nodes"]
    out = []
    for L in range(1, MAX_CHAIN + 1):
        d, n = depths.index(L - 1), nodes.index(L + 1)
        out.append(1.0 + sum(c * acc[d][n] for c, acc in zip(counts, accept)) / total)
    return out


def label_of(cm: CostModel) -> str:
    fp = cm.fingerprint
    flags = " ".join(f for f in fp.get("cpu_flags", []) if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    cap = " AVX2 cap" if fp.get("isa_env") else ""
    busy = (cm.provenance or {}).get("other_cores")
    busy_s = f", measured beside {busy:.1f} busy cores" if busy is not None and busy > 0.25 else ""
    return (f"{fp.get('target_dtype')} target, {fp.get('draft_dtype')} draft, {fp.get('threads')} threads, "
            f"{fp.get('cpu', fp.get('device'))} [{flags}]{cap}{busy_s}")


def bounds(cm: CostModel, goals: Sequence[float], table_tokens: Optional[List[float]]) -> dict:
    grid = [round(0.30 + 0.01 * i, 2) for i in range(66)]        # 0.30 .. 0.95
    curve = [best_over_chains(cm, a) for a in grid]
    free = [best_over_chains(cm, a, draft=False) for a in grid]
    need = {}
    for g in goals:
        hit = next((a for a, (s, _) in zip(grid, curve) if s >= g), None)
        need[str(g)] = hit
    out = {"label": label_of(cm), "fingerprint": cm.fingerprint, "plain_ms": cm.plain_ms(1),
           "verify_ms": {str(n): cm.verify_ms(1, n) for n in range(1, MAX_CHAIN + 2)},
           "draft_ms": {str(f): cm.draft_ms(1, f) for f in range(MAX_CHAIN)},
           "grid": grid, "best": [s for s, _ in curve], "best_chain": [L for _, L in curve],
           "free_best": [s for s, _ in free], "acceptance_needed": need}
    if table_tokens is not None:
        per_L = [round_speedup(cm, t, L) for L, t in enumerate(table_tokens, start=1)]
        i = max(range(len(per_L)), key=per_L.__getitem__)
        # the uniform per-position acceptance with the tables' mean tokens at L = 3
        a3 = min((a / 1000 for a in range(1001)), key=lambda a: abs(chain_tokens(a, 3) - table_tokens[2]))
        out["calibration_chain"] = {"tokens": table_tokens, "speedup": per_L, "best": per_L[i], "best_chain": i + 1,
                                    "first_position": table_tokens[0] - 1.0, "uniform_equivalent_L3": a3}
    return out


def default_costs() -> List[str]:
    from heterospec.costmodel import COSTS_DIR
    from heterospec.defaults import cache_root

    root = os.path.join(str(cache_root()), COSTS_DIR)
    return sorted(p for p in glob.glob(os.path.join(root, "*.json"))
                  if ".online-" not in p and not os.path.basename(p).startswith(("draft-dtype-", "linear-")))


def write(results: List[dict], goals: Sequence[float], out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "goal_bounds.json"), "w") as f:
        json.dump({"goals": list(goals), "results": results}, f, indent=1)
    lines = ["| cost model | plain ms | verify 2 / 4 nodes ms | draft round ms (1 / 3 forwards) | "
             + " | ".join(f"acceptance for {g}x" for g in goals)
             + " | calibration chain: best (L); its a | free chain at a = 0.5 / 0.7 |", "|---" * (6 + len(goals)) + "|"]
    for r in results:
        need = " | ".join("-" if r["acceptance_needed"][str(g)] is None else f"{r['acceptance_needed'][str(g)]:.2f}"
                          for g in goals)
        cal = r.get("calibration_chain")
        cal_s = "-" if cal is None else (f"{cal['best']:.2f}x ({cal['best_chain']}); a = {cal['first_position']:.2f} "
                                         f"first, {cal['uniform_equivalent_L3']:.2f} over 3")
        free = {a: s for a, s in zip(r["grid"], r["free_best"])}
        lines.append(f"| {r['label']} | {r['plain_ms']:.2f} | {r['verify_ms']['2']:.2f} / {r['verify_ms']['4']:.2f} | "
                     f"{r['draft_ms']['1']:.2f} / {r['draft_ms']['3']:.2f} | {need} | {cal_s} | "
                     f"{free[0.5]:.2f}x / {free[0.7]:.2f}x |")
    with open(os.path.join(out_dir, "goal_bounds.md"), "w") as f:
        f.write("Best chain speedup over plain decoding at batch 1 from each cost model "
                "(bench/goal_bounds.py; the draft's per-position acceptance a, the chain length chosen "
                "per a).\n\n" + "\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        line, = ax.plot(r["grid"], r["best"], label=r["label"])
        ax.plot(r["grid"], r["free_best"], ls=":", color=line.get_color())
    for g in goals:
        ax.axhline(g, color="grey", lw=0.8, ls="--")
    cal = next((r["calibration_chain"] for r in results if "calibration_chain" in r), None)
    if cal is not None:
        ax.axvline(cal["uniform_equivalent_L3"], color="grey", lw=0.8, ls="-.")
        ax.annotate("shipped draft, calibration prompts", (cal["uniform_equivalent_L3"], 1.0), fontsize=7,
                    rotation=90, va="bottom", ha="right")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("draft acceptance per position, a (given the positions before it)")
    ax.set_ylabel("best chain round / plain step (tokens per ms)")
    ax.set_title("What a draft must accept to pay on this device (dotted: a free chain, no draft forward)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "goal_bounds.png"), dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", nargs="+", default=None, help="cost model files (default: this machine's cached ones)")
    ap.add_argument("--tables", default=DEFAULT_TABLES, help="chain acceptance tables (calibration prompts)")
    ap.add_argument("--goals", nargs="+", type=float, default=[1.3, 1.5])
    ap.add_argument("--out", default="bench/out/goal-bounds")
    args = ap.parse_args(argv)
    paths = args.costs or default_costs()
    if not paths:
        raise SystemExit("goal_bounds: no cost model found; run `heterospec calibrate` (or any engine run) first, "
                         "or pass --costs")
    table_tokens = table_chain_tokens(args.tables) if args.tables and os.path.isfile(args.tables) else None
    results = [bounds(CostModel.load(p), args.goals, table_tokens) for p in paths]
    write(results, args.goals, args.out)
    with open(os.path.join(args.out, "goal_bounds.md")) as f:
        print(f.read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
