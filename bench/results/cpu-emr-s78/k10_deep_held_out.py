"""The k10 acceptance tables' held-out check with deep plans, on the CPU.

`heterospec calibrate --held-out-only` runs the tables' own plans, and the plans follow the
engine's cost model: on this CPU (10, 7, 60) trees are priced so that the fitted plans reach two
draft positions, and the shipped k10 check (seventy-sixth session) measured only those. A GPU
plans 5-7 positions deep (the sixty-fourth session's H100 e2e run: decide depth 2, depths
6/6/5/5/4/3/2/2, budget 95). Which plan runs changes what is predicted, not what the target
accepts, so the CPU can measure the deep plans' acceptance if its policy plans with a GPU-shaped
cost model. This script builds one from that run's fitted plan (plain step 3.47 ms, a 7-forward
draft 1.48 ms, a ~95-node verify 4.30 ms; flat in tokens as a GPU is at these sizes), checks that
the policy's fitted plan is deep with it, and runs `calibrate.measure_held_out` with it on
held-out prompts, float32.

Usage: python k10_deep_held_out.py PROMPTS.jsonl FIRST N OUT.json SOURCE [--write-tables]
(prompts: lines FIRST..FIRST+N-1 of a {"text": ...} JSON-lines file; SOURCE: what they are, for
the check's prompt_source). --write-tables also writes the check into the shipped
acceptance_tables_k10.json (its `held_out`)."""
import dataclasses
import json
import os
import sys

from heterospec import Engine
from heterospec._io import find_tree_file
from heterospec.calibrate import measure_held_out
from heterospec.config import SpecConfig
from heterospec.costmodel import CostModel
from heterospec.policy import TABLES_FILENAME, AcceptanceTables, FittedPolicy

path, first, n, out, what = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
prompts = [json.loads(line)["text"] for line in open(path)][first:first + n]
assert len(prompts) == n, f"{path} has too few lines"

engine = Engine.from_pretrained(config=SpecConfig(top_k=10, depth=7, total_tokens=60))
tokens = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
gpu = CostModel(
    fingerprint={"device": "cuda", "shape": "H100-shaped, synthetic (sixty-fourth session's e2e plan)"},
    tokens=tokens, contexts=[256], target=[[3.4 + 0.004 * t for t in tokens]],
    batch_sizes=[1], plain=[3.47], draft=[[0.3, 0.17, 0.01, 0.01]],
    nodes=[1, 8, 16, 32, 64, 96, 128], verify=[[3.5, 3.55, 3.6, 3.8, 4.1, 4.3, 4.6]],
    tree_top_k=10, provenance={"date": "synthetic H100 shape", "source": "bench/results/gpu-h100-s64/e2e.json.gz meta"})
engine.cost_model = gpu
tables_path = find_tree_file(engine.draft_dir, TABLES_FILENAME, "k10")
tables = AcceptanceTables.load(tables_path)
plan = FittedPolicy(dataclasses.replace(tables, held_out=None), gpu, engine.config).fitted_plan(1)
print(json.dumps({"tables": tables_path, "plan": {"decide_depth": plan.decide_depth, "entropy_k": plan.entropy_k,
                                                  "depth": plan.depth, "budget": plan.budget}}), flush=True)
check = measure_held_out(engine, tables, prompts, max_new_tokens=128,
                         source=f"{what} ({os.path.basename(path)} lines {first + 1}-{first + n})")
# Deep positions are reached in few rounds, and those few are easy contexts whose copies run on:
# with under MIN_PREDICTED predicted acceptances a position's ratio swung from 0.33 to 1.01
# between runs (seventy-eighth session). Left out, a fresh policy takes such a position as the
# one before it.
MIN_PREDICTED = 100.0
keep = sum(1 for p in check["predicted"] if p >= MIN_PREDICTED)
check["position_scale"], check["predicted"] = check["position_scale"][:keep], check["predicted"][:keep]
check["cost_model"] = "H100-shaped synthetic (k10_deep_held_out.py)"
check["plan"] = {"decide_depth": plan.decide_depth, "depth": plan.depth, "budget": plan.budget}
print(json.dumps(check), flush=True)
with open(out, "w") as f:
    json.dump({"shipped_check": tables.held_out, "deep_check": check}, f, indent=1)
if "--write-tables" in sys.argv:
    tables.held_out = {k: v for k, v in check.items() if k != "plan"}
    tables.save(tables_path)
    print(f"wrote the check into {tables_path}")
