"""bench/goal_bounds.py: the acceptance a draft needs on a device, from its cost curves."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import goal_bounds as gb  # noqa: E402
from heterospec.costmodel import CostModel  # noqa: E402


def model(verify_per_node: float = 2.0, draft_base: float = 1.0, draft_per_forward: float = 0.5) -> CostModel:
    """A batch-1 cost model: plain step 10 ms, verify 10 + verify_per_node per node after the
    root, a draft round draft_base + draft_per_forward per forward (extend tokens free)."""
    nodes = list(range(1, 12))
    return CostModel(fingerprint={"device": "cpu", "target_dtype": "float32", "draft_dtype": "float32",
                                  "threads": 2, "cpu_flags": ["avx2"]},
                     tokens=[1, 64], contexts=[256], target=[[10.0, 10.0]], batch_sizes=[1], plain=[10.0],
                     draft=[[draft_base, draft_per_forward, 0.0]], nodes=nodes,
                     verify=[[10.0 + verify_per_node * (n - 1) for n in nodes]], tree_top_k=1)


def test_speedup_is_tokens_over_cost():
    cm = model()
    # a chain of 2 drafts accepted with a = 0.5: 1.75 tokens for 1 + 0.5 (draft) + 14 (verify 3 nodes)
    assert gb.chain_tokens(0.5, 2) == pytest.approx(1.75)
    assert gb.round_speedup(cm, 1.75, 2) == pytest.approx(1.75 * 10.0 / 15.5)
    assert gb.round_speedup(cm, 1.75, 2, draft=False) == pytest.approx(1.75 * 10.0 / 14.0)


def test_best_chain_and_acceptance_needed():
    cm = model()
    # brute force over L agrees, and a draft that never pays reports no chain
    for a in (0.35, 0.6, 0.9):      # (a = 0.3, L = 1: exactly level with a plain step)
        want = max([(1.0, 0)] + [(gb.round_speedup(cm, gb.chain_tokens(a, L), L), L) for L in range(1, 9)])
        assert gb.best_over_chains(cm, a) == pytest.approx(want)
    assert gb.best_over_chains(model(verify_per_node=20.0), 0.9) == (1.0, 0)
    out = gb.bounds(cm, [1.3, 9.0], None)
    a13 = out["acceptance_needed"]["1.3"]
    assert a13 is not None and out["acceptance_needed"]["9.0"] is None
    i = out["grid"].index(a13)
    assert out["best"][i] >= 1.3 > out["best"][i - 1]
    assert all(b1 <= b2 + 1e-12 for b1, b2 in zip(out["best"], out["best"][1:]))   # more acceptance never hurts
    # cheaper verification needs less acceptance for the same goal
    assert gb.bounds(model(verify_per_node=1.0), [1.3], None)["acceptance_needed"]["1.3"] < a13


def test_calibration_tables_and_files(tmp_path):
    tokens = gb.table_chain_tokens(gb.DEFAULT_TABLES)
    assert len(tokens) == gb.MAX_CHAIN and all(1.0 <= t for t in tokens)
    assert all(t1 <= t2 + 1e-9 for t1, t2 in zip(tokens, tokens[1:]))     # a longer chain never yields less
    path = tmp_path / "cm.json"
    model().save(str(path))
    assert gb.main(["--costs", str(path), "--out", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "goal_bounds.json").read_text())
    assert data["results"][0]["calibration_chain"]["best_chain"] >= 1
    assert (tmp_path / "out" / "goal_bounds.md").read_text().count("|") > 10
