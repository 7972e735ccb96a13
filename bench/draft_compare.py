"""Drafts side by side on the benchmark sets: acceptance by position, tau, top-1/top-3.

What the draft issue measures before and after a retraining, offline (no decoding loop, so it
is independent of the machine's speed): the target answers the first ``--n`` prompts of each
set greedily once (float32, taps recorded in memory, never saved or trained on); then every
draft in ``--drafts`` is scored on exactly those answers:

* chain of ``--chain-depth`` positions (top-1 drafting): conditional acceptance per position,
  P(position i accepted | positions < i were), and tau;
* tau of EAGLE-2 trees: the CPU tree (top_k 4, depth 3 = 4 candidate layers, 8 nodes) and the
  official EAGLE-3 tree (10, 7, 60 = 8 candidate layers), as ``train-draft simulate`` runs them;
* top-1 / top-3 agreement of the first draft position with the target's greedy token.

    python bench/draft_compare.py --drafts heterospec/assets/smollm2-135m-instruct-eagle3 \\
        ~/.cache/heterospec/draft-runs/v3/ckpt_best.pt --labels shipped new --n 6

Writes ``OUT/draft_compare.json``, ``.md`` and ``draft_acceptance.png`` (acceptance by
position, one line per draft, one panel per set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

SETS = ("mtbench", "humaneval", "gsm", "alpaca", "cnndm")
# (top_k, candidate layers, nodes) of simulate_acceptance; engine depth d = d + 1 layers
TREES = {"cpu (4, 3, 8)": (4, 4, 8), "official (10, 7, 60)": (10, 8, 60)}


def first_position_topk(draft, seqs, ks=(1, 3)) -> dict:
    """Agreement of draft position 0 with the target's greedy next token, over response rows."""
    hits = {k: 0 for k in ks}
    total = 0
    with torch.no_grad():
        for q in seqs:
            toks, P = q.tokens.long(), q.prompt_len
            n = toks.numel()
            if n - P < 2:
                continue
            feats = torch.cat([q.features.float(), torch.zeros(1, q.features.shape[1])]).to(draft.device)
            toks = toks.to(draft.device)
            out = draft.forward_train(toks[None], feats[None], ttt_steps=1, return_logits=True)
            rows = torch.arange(P - 1, n - 2, device=draft.device)  # row p predicts token p + 2
            want = toks[rows + 2]
            top = draft.to_target_ids(out.logits[0][0, rows].topk(max(ks), dim=-1).indices)
            for k in ks:
                hits[k] += int((top[:, :k] == want[:, None]).any(-1).sum())
            total += rows.numel()
    return {f"top{k}": hits[k] / max(1, total) for k in ks} | {"rows": total}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", nargs="+", required=True,
                    help="exported draft dirs or training checkpoints (ckpt_*.pt)")
    ap.add_argument("--labels", nargs="+", default=None)
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    ap.add_argument("--n", type=int, default=6, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--chain-depth", type=int, default=6)
    ap.add_argument("--no-official-tree", action="store_true", help="skip the (10, 7, 60) tree")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu",
                    help="cpu or cuda[:N]: where the target answers and the drafts are scored "
                         "(the scores do not depend on it beyond rounding)")
    ap.add_argument("--out", default="bench/out/draft_compare")
    args = ap.parse_args(argv)
    labels = args.labels or [Path(d).name for d in args.drafts]
    if len(labels) != len(args.drafts):
        ap.error("--labels must name every draft")
    if args.n < 1 or args.max_new_tokens < 2 or args.chain_depth < 1:
        ap.error("--n >= 1, --max-new-tokens >= 2 and --chain-depth >= 1 are required")
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    from heterospec.train.trainer import (benchmark_sequences, conditional_acceptance, load_draft,
                                          load_target_for_training, simulate_acceptance)

    device = torch.device(args.device)
    target = load_target_for_training().to(device)
    drafts = {lab: load_draft(os.path.expanduser(d), target).to(device)
              for lab, d in zip(labels, args.drafts)}
    trees = {k: v for k, v in TREES.items() if not (args.no_official_tree and k.startswith("official"))}
    res = {"drafts": dict(zip(labels, args.drafts)), "n": args.n, "device": str(device),
           "max_new_tokens": args.max_new_tokens, "chain_depth": args.chain_depth,
           "trees": trees, "sets": {}}
    t0 = time.time()
    for name in args.sets:
        seqs = benchmark_sequences(target, name, args.n, args.max_new_tokens)
        per = {}
        for lab, draft in tqdm(drafts.items(), desc=name, leave=False):
            chain = simulate_acceptance(draft, seqs, top_k=1, depth=args.chain_depth,
                                        nodes=args.chain_depth)
            row = {"chain_tau": chain["tau"], "chain_hist": chain["accept_hist"],
                   "cond_accept": conditional_acceptance(chain["accept_hist"])}
            for tname, (k, depth, nodes) in trees.items():
                row[f"tau {tname}"] = simulate_acceptance(draft, seqs, top_k=k, depth=depth,
                                                          nodes=nodes)["tau"]
            row.update(first_position_topk(draft, seqs))
            per[lab] = row
        res["sets"][name] = {"response_tokens": sum(q.tokens.numel() - q.prompt_len for q in seqs),
                             "drafts": per}
        print(name, json.dumps({lab: {k: (round(v, 3) if isinstance(v, float) else v)
                                      for k, v in r.items() if k != "chain_hist"}
                                for lab, r in per.items()}), flush=True)
    res["seconds"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_compare.json").write_text(json.dumps(res, indent=1))
    (out / "draft_compare.md").write_text(markdown(res, labels))
    plot(res, labels, out / "draft_acceptance.png")
    print(markdown(res, labels))
    return 0


def _mean(xs):
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def markdown(res: dict, labels: list[str]) -> str:
    tcols = [f"tau {t}" for t in res["trees"]]
    head = ["set", "draft", "cond. acceptance by position", "chain tau", *tcols, "top-1", "top-3"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mean = {lab: {} for lab in labels}
    for name, s in res["sets"].items():
        for lab in labels:
            r = s["drafts"][lab]
            cells = [name, lab, " ".join(f"{a:.2f}" for a in r["cond_accept"]), f"{r['chain_tau']:.3f}",
                     *[f"{r[c]:.3f}" for c in tcols], f"{r['top1']:.3f}", f"{r['top3']:.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
            for k in ["chain_tau", *tcols, "top1", "top3"]:
                mean[lab].setdefault(k, []).append(r[k])
            mean[lab].setdefault("cond", []).append(r["cond_accept"])
    for lab in labels:
        m = mean[lab]
        cond = [_mean(col) for col in zip(*m["cond"])]
        cells = ["**mean**", lab, " ".join(f"{a:.2f}" for a in cond), f"{_mean(m['chain_tau']):.3f}",
                 *[f"{_mean(m[c]):.3f}" for c in tcols], f"{_mean(m['top1']):.3f}", f"{_mean(m['top3']):.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(res: dict, labels: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    sets = list(res["sets"])
    fig, axes = plt.subplots(1, len(sets), figsize=(3.2 * len(sets), 3.2), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], sets):
        for lab in labels:
            c = res["sets"][name]["drafts"][lab]["cond_accept"]
            ax.plot(range(1, len(c) + 1), c, marker="o", label=lab)
        ax.set_title(name)
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1)
        ax.axhline(0.6, color="grey", lw=0.6, ls="--")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("P(accepted | earlier accepted)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Draft acceptance by position (chain, greedy target answers)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
