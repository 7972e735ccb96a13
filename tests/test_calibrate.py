"""Data-driven entropy partitioning: CART bin fitting, label extraction, files, engine calibration."""

import json
import math
import warnings

import numpy as np
import pytest

from heterospec.calibrate import fit_bins, rank_rises_with_entropy, traces_from_records
from heterospec.config import SpecConfig
from heterospec.engine import Engine, RoundRecord
from heterospec.entropy import BINS_FILENAME, EntropyBins
from heterospec.policy import PaperPolicy
from tests.engine_util import OracleDraft, tiny_hf_llama

TRUE_EDGES = [1.0, 2.0, 3.5, 4.0, 5.5, 7.0, 8.0]


def _synthetic(n=4000, noise=0.3, seed=0):
    """Rank is a step function of entropy with 8 levels (known edges) plus noise."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.0, 9.0, n)
    level = np.searchsorted(TRUE_EDGES, x, side="left")   # bin i: edges[i-1] < x <= edges[i]
    y = 1.0 + 4.0 * level + rng.normal(0.0, noise, n)
    return x, y


def test_cart_recovers_known_bin_edges():
    x, y = _synthetic()
    bins = fit_bins(x, y)
    assert bins.num_bins == 8
    assert np.allclose(bins.edges, TRUE_EDGES, atol=0.05), bins.edges
    assert rank_rises_with_entropy(bins)
    assert sum(bins.bin_counts) == len(x)
    assert bins.bin_mean_rank[0] < bins.bin_mean_rank[-1]


def test_cart_with_fewer_levels_and_lookup_rule():
    rng = np.random.default_rng(1)
    x = rng.uniform(0, 4, 2000)
    y = np.where(x > 2.0, 10.0, 1.0) + rng.normal(0, 0.1, x.size)
    bins = fit_bins(x, y)
    assert any(abs(e - 2.0) < 0.05 for e in bins.edges)
    # CART's "left is x <= s": an entropy equal to an edge belongs to the lower bin.
    e = bins.edges[0]
    assert bins.bin_of(e) == 0 and bins.bin_of(math.nextafter(e, math.inf)) == 1
    assert bins.bin_of(float("nan")) == bins.num_bins - 1


def test_fit_bins_rejects_bad_traces():
    with pytest.raises(ValueError, match="at least"):
        fit_bins([0.1, 0.2], [1, 2])
    with pytest.raises(ValueError, match="finite"):
        fit_bins([0.1] * 9 + [float("nan")], list(range(10)))
    with pytest.raises(ValueError, match="entropies but"):
        fit_bins([0.1] * 10, [1] * 9)


def test_labels_from_round_records():
    recs = [RoundRecord(accept_len=2, verified=8, depth=4, entropy=0.5, bin=-1, tcr=3, pstar_rank=2,
                        pstar_accepted=True, draft_s=0, verify_s=0),
            RoundRecord(accept_len=0, verified=8, depth=4, entropy=2.5, bin=-1, tcr=8, pstar_rank=5,
                        pstar_accepted=False, draft_s=0, verify_s=0)]
    x, y = traces_from_records(recs, "tcr")
    assert x.tolist() == [0.5, 2.5] and y.tolist() == [3, 8]
    x, y = traces_from_records(recs, "pstar_rank")         # only fully accepted P*
    assert x.tolist() == [0.5] and y.tolist() == [2]
    with pytest.raises(ValueError, match="unknown calibration label"):
        traces_from_records(recs, "median")


def test_bins_file_round_trip_and_errors(tmp_path):
    bins = EntropyBins([0.5, 1.5], provenance={"prompts": 3}, bin_mean_rank=[1.0, 2.0, 3.0], bin_counts=[1, 2, 3])
    path = tmp_path / BINS_FILENAME
    bins.save(str(path))
    again = EntropyBins.load(str(path))
    assert again.edges == bins.edges and again.provenance == {"prompts": 3}
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        EntropyBins.load(str(tmp_path / "bad.json"))
    (tmp_path / "noedges.json").write_text(json.dumps({"x": 1}))
    with pytest.raises(ValueError, match="edges"):
        EntropyBins.load(str(tmp_path / "noedges.json"))
    with pytest.raises(ValueError, match="ascending"):
        EntropyBins([2.0, 1.0])
    for edges in ("12", None, 3.0, {"a": 1}):
        with pytest.raises(ValueError, match="edges must be a list of numbers"):
            EntropyBins(edges)
    for edges in (["a"], [[1.0]], [True]):
        with pytest.raises(ValueError, match="edges must be numbers"):
            EntropyBins(edges)
    assert EntropyBins(np.array([0.5, 1.5])).edges == [0.5, 1.5]
    for name, data, msg in [("nulledges", {"edges": None}, "edges must be a list"),
                            ("stredges", {"edges": ["a", "b"]}, "edges must be numbers"),
                            ("badprov", {"edges": [1.0], "provenance": [1, 2]}, "provenance must be a dict"),
                            ("badtree", {"edges": [1.0], "provenance": {"tree": "x"}}, r"provenance\['tree'\]")]:
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=f"{name}.json: .*{msg}"):
            EntropyBins.load(str(tmp_path / f"{name}.json"))
    with pytest.raises(FileNotFoundError):
        EntropyBins.load(str(tmp_path / "missing.json"))
    # a provenance value JSON cannot hold fails the save and leaves no temporary file behind
    bad = EntropyBins([1.0], provenance={"draft": object()})
    with pytest.raises(TypeError):
        bad.save(str(tmp_path / "unsavable.json"))
    assert sorted(p.name for p in tmp_path.iterdir() if "unsavable" in p.name) == []


def test_bin_actions_follow_the_paper_formulas():
    cfg = SpecConfig(top_k=10, depth=7, total_tokens=60)        # alpha = ceil(7 / 2) = 4
    extra, nodes = cfg.bin_actions(8)
    assert extra == [4, 3, 2, 0, 0, 0, 0, 0]
    assert nodes == [22, 39, 62, 60, 60, 60, 60, 60]           # round(gamma_i * 60 + 4 - i)
    plan = PaperPolicy(EntropyBins([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]), cfg).plan(1)
    import torch
    b, d, n = plan.decide(torch.tensor([0.5, 1.0, 1.5, 2.5, 9.0]))
    assert b.tolist() == [0, 0, 1, 2, 7]
    assert d.tolist() == [11, 11, 10, 9, 7] and n.tolist() == [21, 21, 38, 61, 59]


def test_engine_calibration_end_to_end(tmp_path):
    hf = tiny_hf_llama(seed=21)
    draft = OracleDraft(hf, noise=2.0, seed=3)
    engine = Engine(hf, draft, config=SpecConfig(top_k=3, depth=3, total_tokens=10))
    engine.draft_dir = tmp_path     # a Path, as Engine.from_pretrained() gives for the built-in draft
    prompts = [[5 + i, 9, 17 + i, 33] for i in range(6)]
    draft.set_prompts(prompts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # a random pair may not show rising ranks
        bins = engine.calibrate(prompts, max_new_tokens=20, save=True, progress=False)
    saved = EntropyBins.load(str(tmp_path / BINS_FILENAME))
    assert saved.edges == bins.edges and 2 <= bins.num_bins <= 8
    p = saved.provenance
    assert p["prompts"] == 6 and p["rounds"] >= 8 and p["label"] == "tcr" and "date" in p
    assert p["draft"] == str(tmp_path) and p["target"] == "hf_model"
    assert engine.bins is bins
    # The next heterospec run uses them.
    draft.set_prompts(prompts[:1])
    out = engine.generate(prompts[0], max_new_tokens=10, method="heterospec")
    assert all(r.bin == bins.bin_of(r.entropy) for r in out.stats.records)
    # A prompt too long for the engine is named by its index in the calibration list.
    long_prompt = [5] * (engine.max_length - 10)
    draft.set_prompts([prompts[0], long_prompt])
    with pytest.raises(ValueError, match=r"calibration prompt 1: the prompt has \d+ tokens"):
        engine.calibrate([prompts[0], long_prompt], max_new_tokens=20, progress=False)


def test_non_monotone_ranks_are_detected():
    x = np.linspace(0, 8, 400)
    y = np.where(x > 4, 1.0, 10.0)                             # rank falls with entropy
    bins = fit_bins(x, y)
    assert not rank_rises_with_entropy(bins)
