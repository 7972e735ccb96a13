"""Replay the fitted policy offline: what its plans deliver on recorded traces under a cost model.

Traces are the calibration traces (``heterospec.calibrate.collect_traces``): per round, the
accepted length of every action of the grid (draft forwards x verified nodes) and H(P*) of every
binning option. A plan's tokens/s on them is exact for its actions (no tables, no corrections):
the accepted length its action really had in each round, priced by a cost model. This separates
what the *cost model* makes the policy choose from what the *tables* make it choose, which the
end-to-end benchmark cannot: ``--fit-costs`` are the models plans are fitted with,
``--eval-costs`` the one they are priced by (a quiet measurement of the device).

    # traces of the benchmark sets' prompts 8-15 (the benchmark itself uses 0-3), then replay
    python bench/policy_replay.py --sets mtbench humaneval gsm alpaca cnndm --skip 8 --n 8 \\
        --traces /tmp/bench-tail.pkl --fit-costs busy.json quiet.json --eval-costs quiet.json

Prints, per fitted cost model and per table set (the draft's shipped tables, and tables fitted on
the traces themselves = what perfect calibration would give), the plan's actions and its tokens/s
relative to EAGLE-3's fixed tree and to plain decoding on the same traces.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def replay(traces: dict, cost, opt, depth, nodes) -> dict:
    """Tokens/s of per-bin actions ``depth[i]`` forwards / ``nodes[i]`` verified nodes (root
    included) on ``traces``, binned by ``opt`` (None: one bin), priced by ``cost`` at batch 1."""
    acc, D, N = traces["accept"], list(traces["depths"]), list(traces["nodes"])
    if opt is None:
        b = np.zeros(acc.shape[0], dtype=int)
    else:
        b = np.searchsorted(np.asarray(opt.edges), traces["entropy"][(opt.decide_depth, opt.entropy_k)], side="right")
    a = np.array([acc[r, D.index(depth[b[r]]), N.index(nodes[b[r]])] for r in range(len(b))], dtype=float)
    mean_new = float((a + 1).mean())
    ms = sum(cost.draft_ms(1, depth[i], mean_new) + cost.verify_ms(1, nodes[i]) for i in b)
    return {"tokens_per_s": 1e3 * float((a + 1).sum()) / ms, "accepted": float(a.mean()),
            "nodes": float(np.mean([nodes[i] for i in b]))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", nargs="+", default=["mtbench", "humaneval", "gsm", "alpaca", "cnndm"],
                    help="prompt sets to record traces on ('calibration' = heterospec calibrate's split)")
    ap.add_argument("--n", type=int, default=8, help="prompts per set")
    ap.add_argument("--skip", type=int, default=8, help="skip each set's first prompts (those benchmarked)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--traces", required=True, help="pickle of recorded traces: read if present, else recorded")
    ap.add_argument("--fit-costs", nargs="+", required=True, help="cost model files the plans are fitted with")
    ap.add_argument("--eval-costs", required=True, help="cost model file the plans are priced by")
    ap.add_argument("--tables", help="acceptance tables (default: the built-in draft's)")
    args = ap.parse_args(argv)

    from heterospec.calibrate import fit_tables
    from heterospec.costmodel import CostModel
    from heterospec.policy import AcceptanceTables, fit_plan

    if os.path.exists(args.traces):
        with open(args.traces, "rb") as f:
            traces = pickle.load(f)
    else:
        from heterospec.bench import load_prompt_sets
        from heterospec.calibrate import collect_traces
        from heterospec.engine import Engine
        engine = Engine.from_pretrained()
        prompts = []
        for name in args.sets:
            if name == "calibration":
                from heterospec.train.prompts import calibration_prompts
                prompts += calibration_prompts(args.n)[0]
            else:
                prompts += [p.text for p in load_prompt_sets([name], args.skip + args.n)[name][args.skip:]]
        traces = collect_traces(engine, prompts, max_new_tokens=args.max_new_tokens)
        traces["default_action"] = (engine.config.depth, engine.config.total_tokens)
        traces["prompt_sets"] = list(args.sets)
        with open(args.traces, "wb") as f:
            pickle.dump(traces, f)
    shipped = args.tables
    if shipped is None:
        from heterospec.defaults import default_draft_dir
        shipped = os.path.join(str(default_draft_dir()), "acceptance_tables.json")
    tables = {"shipped tables": AcceptanceTables.load(shipped), "tables of these traces": fit_tables(traces)}
    price = CostModel.load(args.eval_costs)
    d0, n0 = traces["default_action"]
    base = replay(traces, price, None, [d0], [n0])
    plain = 1e3 / price.plain_ms(1)
    print(f"{traces['accept'].shape[0]} rounds; priced by {args.eval_costs}: eagle3 (depth {d0}, {n0} nodes) "
          f"{base['tokens_per_s']:.1f} tok/s (accepted {base['accepted']:.2f}), plain {plain:.1f} tok/s")
    rows = []
    for fit_path in args.fit_costs:
        fit_cost = CostModel.load(fit_path)
        for label, t in tables.items():
            plan = fit_plan(t, fit_cost, 1)
            plan = plan if plan.speculate else plan.alternative
            opt = t.options[plan.expected["option"]]
            nodes = [n + 1 for n in plan.budget]
            r = replay(traces, price, opt, plan.depth, nodes)
            rows.append({"fit_costs": fit_path, "tables": label, "option": plan.expected["option"],
                         "depth": plan.depth, "nodes": nodes, **r,
                         "vs_eagle3": r["tokens_per_s"] / base["tokens_per_s"], "vs_plain": r["tokens_per_s"] / plain})
            print(f"  fitted with {os.path.basename(fit_path)}, {label}: depth {plan.depth} nodes {nodes} -> "
                  f"{r['tokens_per_s']:.1f} tok/s = {rows[-1]['vs_eagle3']:.3f}x eagle3, {rows[-1]['vs_plain']:.2f}x plain "
                  f"(accepted {r['accepted']:.2f}, {r['nodes']:.1f} nodes)")
    print(json.dumps({"eagle3": base, "plain_tokens_per_s": plain, "plans": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
