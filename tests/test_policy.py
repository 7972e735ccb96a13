"""HeteroSpec's policies: the fitted per-bin actions, the paper's formulas, the cost model, and
batched rounds whose requests take different actions (lossless, greedy and sampled)."""

import itertools
import json
import math
import os
import warnings

import pytest
import torch

from heterospec import Engine, SpecConfig, costmodel
from heterospec.calibrate import calibrate_policy, measure_held_out
from heterospec.entropy import EntropyBins
from heterospec.policy import (AcceptanceTables, BinningOption, FittedPolicy, PaperPolicy, Plan, Policy,
                               action_survival,
                               _corrected_accept_matrix, _expected_fn_of_max, _expected_of_max_rows,
                               _survival_matrix, _option_actions, corrected_accept, fit_plan, paper_actions,
                               plan_cost)
from tests.engine_util import OracleDraft, tiny_hf_llama


# ---------------------------------------------------------------------------------------------
# Synthetic acceptance and cost
# ---------------------------------------------------------------------------------------------
class LinearCost:
    """A cost model with known curves: verify a + b*B*N, draft B*(c + e*forwards), plain a + b*B."""

    def __init__(self, a=10.0, b=1.0, c=1.0, e=1.0):
        self.a, self.b, self.c, self.e = a, b, c, e

    def verify_ms(self, B, nodes, context=256):
        return self.a + self.b * B * nodes

    def plain_ms(self, B, context=256):
        return self.a + self.b * B

    def draft_ms(self, B, forwards, extend_tokens=1.0):
        return B * (self.c + self.e * forwards)


class ExtendCost(LinearCost):
    """LinearCost whose draft also pays 0.5 ms per request for each extend token beyond the first
    (the catch-up after plain steps)."""

    def draft_ms(self, B, forwards, extend_tokens=1.0):
        return B * (self.c + self.e * forwards) + 0.5 * B * max(extend_tokens - 1.0, 0.0)


class StepCost:
    """A device where verifying two or more tokens jumps to ``verify_two`` ms (a one-token step:
    10 ms); draft ``draft[0] + draft[1] * forwards`` ms."""

    def __init__(self, verify_two: float, draft=(0.5, 0.5)):
        self.verify_two, self.draft = verify_two, draft

    def verify_ms(self, B, n, context=256):
        return 10.0 if n <= 1 else self.verify_two + 0.2 * n

    def plain_ms(self, B, context=256):
        return 10.0

    def draft_ms(self, B, forwards, extend_tokens=1.0):
        return self.draft[0] + self.draft[1] * forwards


DEPTHS, NODES = [0, 1, 2, 3, 4], [1, 2, 3, 4, 6, 8]


def _tables(easy_accept=0.9, hard_accept=0.05, counts=(60, 40), decide_depth=1):
    """Bin 0: a chain the draft gets right with probability ``easy_accept`` per layer; bin 1:
    almost nothing is accepted. accept[d][N] = expected accepted drafts with d forwards, N nodes."""
    def table(p):
        out = []
        for d in DEPTHS:
            row = []
            for n in NODES:
                reach = min(d + 1, n - 1)          # a chain: one node per layer
                row.append(sum(p ** i for i in range(1, reach + 1)))
            out.append(row)
        return out
    opt = BinningOption(decide_depth, 4, "accept", [1.0], list(counts), [table(easy_accept), table(hard_accept)])
    return AcceptanceTables(4, DEPTHS, NODES, [opt])


def _brute_force(tables, cost, B, ragged=False):
    opt = tables.options[0]
    probs = [c / sum(opt.counts) for c in opt.counts]
    acts = [(d, n, di, ni) for di, d in enumerate(tables.depths) for ni, n in enumerate(tables.nodes)
            if d >= opt.decide_depth and not (d > opt.decide_depth and n - 1 < d + 1)]
    best = None
    for combo in itertools.product(acts, repeat=len(probs)):
        ev = plan_cost(cost, B, opt.decide_depth, probs, [a[0] for a in combo], [a[1] for a in combo],
                       [opt.accept[i][a[2]][a[3]] for i, a in enumerate(combo)], 256, ragged)
        if best is None or ev["tokens_per_s"] > best[0]:
            best = (ev["tokens_per_s"], [(a[0], a[1] - 1) for a in combo])
    return best


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("B", [1, 2, 4])
def test_fitted_plan_is_the_optimum_of_synthetic_tables(B, ragged):
    tables, cost = _tables(), LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    plan = fit_plan(tables, cost, B, margin=1.0, ragged=ragged)
    best_tps, best_actions = _brute_force(tables, cost, B, ragged)
    assert plan.speculate
    assert list(zip(plan.depth, plan.budget)) == best_actions
    assert plan.expected["speculative"]["tokens_per_s"] == pytest.approx(best_tps)
    if B == 1:   # alone, the easy bin drafts deeper and the hard one verifies fewer nodes
        assert plan.depth[0] > plan.depth[1] and plan.budget[1] < plan.budget[0]
    else:        # in a batch the deepest request sets the draft's cost: depths level out
        assert plan.depth[0] <= fit_plan(tables, cost, 1, margin=1.0, ragged=ragged).depth[0]


def test_fitted_plan_turns_speculation_off_where_it_does_not_pay():
    tables = _tables()
    # A draft forward as costly as a target step: no action beats plain decoding.
    plan = fit_plan(tables, LinearCost(a=10.0, b=1.0, c=10.0, e=10.0), 1)
    assert not plan.speculate and plan.expected["speculative"]["tokens_per_s"] < plan.expected["plain"]["tokens_per_s"]
    # Cheap draft, but verification grows steeply with tokens: large batches stop speculating.
    cost = LinearCost(a=2.0, b=3.0, c=0.2, e=0.2)
    plans = {B: fit_plan(tables, cost, B) for B in (1, 16)}
    assert plans[1].speculate and not plans[16].speculate
    # The margin: speculation predicted 1 % faster than plain is not switched on by default.
    p = fit_plan(tables, cost, 1, margin=1.0)
    ratio = p.expected["speculative"]["tokens_per_s"] / p.expected["plain"]["tokens_per_s"]
    assert fit_plan(tables, cost, 1, margin=ratio * 1.01).speculate is False


def test_every_policy_keeps_the_budget_reaching_the_extended_depth():
    for top_k, depth, total in [(4, 3, 8), (3, 3, 10), (10, 7, 60), (2, 5, 4), (4, 1, 3)]:
        cfg = SpecConfig(top_k=top_k, depth=depth, total_tokens=total)
        plan = PaperPolicy(EntropyBins([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]), cfg).plan(1)
        for d, n in zip(plan.depth, plan.budget):
            assert d == plan.decide_depth or n >= d + 1, (cfg, plan.depth, plan.budget)
    for B in (1, 2, 8):
        for cost in (LinearCost(), LinearCost(a=1.0, b=0.01, c=0.01, e=0.01), LinearCost(a=5, b=2, c=0.1, e=3)):
            plan = fit_plan(_tables(), cost, B, margin=1.0)
            for d, n in zip(plan.depth, plan.budget):
                assert d == plan.decide_depth or n >= d + 1
    with pytest.raises(ValueError, match="extended layers could never be verified"):
        Plan("bad", decide_depth=1, entropy_k=2, edges=[], depth=[3], budget=[2])


def test_paper_actions_follow_the_formulas_where_the_invariant_holds():
    cfg = SpecConfig(top_k=10, depth=7, total_tokens=60)
    assert paper_actions(cfg, 8) == ([11, 10, 9, 7, 7, 7, 7, 7], [21, 38, 61, 59, 59, 59, 59, 59])
    # CPU tree: round(0.3 * 8 + 2) = 4 nodes for 6 layers -> raised to 6 draft nodes.
    depth, budget = paper_actions(SpecConfig(top_k=4, depth=3, total_tokens=8), 8)
    assert depth[:3] == [5, 4, 3] and budget[:3] == [6, 5, 7]


def test_tables_round_trip_and_reject_bad_shapes(tmp_path):
    t = _tables()
    t.save(str(tmp_path / "t.json"))
    back = AcceptanceTables.load(str(tmp_path / "t.json"))
    assert back.to_dict() == t.to_dict()
    with pytest.raises(ValueError, match=r"\[depths\]\[nodes\]"):
        AcceptanceTables(4, DEPTHS, NODES, [BinningOption(1, 4, "accept", [], [1], [[[0.0]]])])
    (tmp_path / "bad.json").write_text('{"top_k": 4}')
    with pytest.raises(ValueError, match="bad.json"):
        AcceptanceTables.load(str(tmp_path / "bad.json"))


# ---------------------------------------------------------------------------------------------
# Cost model files
# ---------------------------------------------------------------------------------------------
def _tiny_engine(seed=21, **kw):
    hf = tiny_hf_llama(seed=seed)
    draft = OracleDraft(hf, noise=1.0, seed=3)
    return Engine(hf, draft, config=SpecConfig(top_k=3, depth=2, total_tokens=6), **kw), draft, hf


def test_cost_model_from_another_device_is_reported_not_used(tmp_path):
    engine, _, _ = _tiny_engine()
    cm = costmodel.CostModel(fingerprint=costmodel.fingerprint(engine), tokens=[1, 8], contexts=[128],
                             target=[[5.0, 9.0]], batch_sizes=[1], plain=[5.0], draft=[[1.0, 1.0, 0.1]],
                             nodes=[1, 8], verify=[[5.5, 10.0]], tree_top_k=3)
    here = tmp_path / "here.json"
    cm.save(str(here))
    assert costmodel.load_for(engine, str(here)).to_dict() == cm.to_dict()
    cm.fingerprint = dict(cm.fingerprint, cpu="Another CPU", target_dtype="bfloat16")
    there = tmp_path / "there.json"
    cm.save(str(there))
    with pytest.warns(UserWarning, match=r"measured elsewhere.*cpu: 'Another CPU'.*target_dtype"):
        assert costmodel.load_for(engine, str(there)) is None


def test_a_cost_model_timed_with_other_kernels_is_measured_again(tmp_path, monkeypatch):
    """The fingerprint names the ops' library (a hash of it): costs timed with an older or rebuilt
    build of the kernels are not this build's. Given by path, such a file is reported and not
    used; cached, it sits where this build looks (the library is not in the cache key), and a
    quick one is measured again there (the online state beside it keeps its acceptance: the
    stamp rule of FittedPolicy.load_state), a full one is used with a warning."""
    from heterospec import _ext
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    engine, _, _ = _tiny_engine(seed=26)
    fp = costmodel.fingerprint(engine)
    assert fp["kernels"] == _ext.kernels_id() and len(fp["kernels"]) == 12
    old = _quick_model(engine, 0.0)
    old.fingerprint = dict(fp, kernels="0" * 12)
    old.save(str(tmp_path / "old.json"))
    with pytest.warns(UserWarning, match=r"measured elsewhere.*kernels: '000000000000'"):
        assert costmodel.load_for(engine, str(tmp_path / "old.json")) is None
    path = costmodel.cache_path(fp)
    assert costmodel.cache_path(old.fingerprint) == path
    fresh = _quick_model(engine, 0.0)
    fresh.provenance["date"] = "now"
    calls = []
    monkeypatch.setattr(costmodel, "measure", lambda eng, **kw: calls.append(kw) or fresh)
    old.save(path)
    assert costmodel.for_engine(engine, progress=False).provenance["date"] == "now" and len(calls) == 1
    assert costmodel.CostModel.load(path).fingerprint == fp
    assert costmodel.for_engine(engine, progress=False).provenance["date"] == "now" and len(calls) == 1
    old.quick = False
    old.save(path)
    with pytest.warns(UserWarning, match=r"timed with another build of heterospec's ops.*heterospec costs"):
        assert costmodel.for_engine(engine, progress=False).provenance["date"] == "then"
    assert len(calls) == 1


def test_cost_model_measures_the_engines_phases_in_steady_state(monkeypatch):
    """``measure`` runs the engine's own phases and returns a usable model; its plain steps run
    as between rounds (one token pending for the draft), not with the whole prompt pending."""
    from heterospec import Eagle3Draft, TargetModel
    target = TargetModel.from_hf(tiny_hf_llama(seed=5))
    engine = Engine(target, Eagle3Draft.for_target(target, seed=5), config=SpecConfig(top_k=3, depth=2, total_tokens=6))
    pending = []
    decode_one = engine._decode_one

    def spy(st, *a, **k):
        pending.append(st.ext_num.tolist())
        return decode_one(st, *a, **k)

    monkeypatch.setattr(engine, "_decode_one", spy)
    cm = costmodel.measure(engine, quick=False, batch_sizes=(1, 3), tokens=(1, 2, 4), contexts=(32, 64),
                           repeats=1, progress=False, node_grid=(1, 2, 4))
    assert pending and all(p == [1] * len(p) for p in pending), pending
    assert cm.batch_sizes == [1, 3] and cm.nodes == [1, 2, 4] and cm.fingerprint == costmodel.fingerprint(engine)
    values = [x for row in cm.target + cm.draft + cm.verify for x in row] + cm.plain
    assert all(len(row) == 4 for row in cm.draft)          # (the long extend slope, from 32 tokens here)
    assert all(math.isfinite(x) and x >= 0 for x in values)
    assert all(cm.target[c][i] <= cm.target[c][i + 1] for c in range(2) for i in range(2))   # spikes lowered
    for B in (1, 2, 3):
        assert cm.plain_ms(B) > 0 and cm.verify_ms(B, 3) > 0 and cm.draft_ms(B, 2, 2.0) > 0


def test_a_quick_cost_model_times_the_target_at_two_contexts():
    """A quick model (batch 1) still measures the target's curve at two contexts, so a plain step
    and a round are priced by their context (the guard scales its rounds by it); contexts that do
    not fit the engine's max_length are left out."""
    from heterospec import Eagle3Draft, TargetModel
    target = TargetModel.from_hf(tiny_hf_llama(seed=5))
    engine = Engine(target, Eagle3Draft.for_target(target, seed=5), config=SpecConfig(top_k=3, depth=2, total_tokens=6))
    cm = costmodel.measure(engine, quick=True, tokens=(1, 2, 4), contexts=(64, 32, 16), repeats=1, progress=False)
    assert cm.contexts == [16, 32] and len(cm.target) == 2 and cm.batch_sizes == [1]
    assert cm.plain_ms(1, 32) >= cm.plain_ms(1, 16) > 0
    too_long = costmodel.measure(engine, quick=True, tokens=(1, 2, 4), contexts=(32, engine.max_length),
                                 repeats=1, progress=False)
    assert too_long.contexts == [32]


def test_cost_model_interleaves_the_phases_it_times(monkeypatch):
    """Each pass runs every phase once (plain step, draft trees, verification per N): a machine
    whose speed drifts during the measurement shifts them alike instead of skewing their ratios
    (measured one after another, a slow spell priced a plain step above a 1-node verify)."""
    from heterospec import Eagle3Draft, TargetModel
    target = TargetModel.from_hf(tiny_hf_llama(seed=5))
    engine = Engine(target, Eagle3Draft.for_target(target, seed=5), config=SpecConfig(top_k=3, depth=2, total_tokens=6))
    order = []
    for name in ("_decode_one", "_draft_tree", "_verify"):
        real = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, _r=real, _n=name, **k: (order.append(_n), _r(*a, **k))[1])
    costmodel.measure(engine, quick=True, repeats=3, progress=False)
    plain = [i for i, n in enumerate(order) if n == "_decode_one"]
    assert len(plain) == 4                                   # a warm-up and 3 timed runs
    assert all(b - a > 1 for a, b in zip(plain, plain[1:])), order   # never two in a row
    assert order.count("_verify") == 4 * 8                   # 8 node counts of the quick grid


def test_cost_model_times_replayed_halves_when_the_engine_uses_graphs(monkeypatch):
    """With CUDA graphs (emulated here) the cost model times what the engine runs: the round
    halves and plain steps replayed from graphs, not eager forwards (launch-bound on a GPU)."""
    from heterospec import Eagle3Draft, TargetModel
    from heterospec.graphs import RoundGraphs
    target = TargetModel.from_hf(tiny_hf_llama(seed=5))
    engine = Engine(target, Eagle3Draft.for_target(target, seed=5), config=SpecConfig(top_k=3, depth=2, total_tokens=6))
    engine.static_rounds = True
    engine.round_graphs = RoundGraphs("cpu", emulate=True)
    engine.draft.kernel_friendly_attention = True
    halves = []
    for name in ("_draft_half", "_verify_half"):
        real = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, _r=real, _n=name, **k: (halves.append(_n), _r(*a, **k))[1])
    cm = costmodel.measure(engine, quick=True, repeats=1, progress=False)
    assert "_draft_half" in halves and "_verify_half" in halves
    c = engine.round_graphs.counts
    assert c["captured"] >= 3 and c["replayed"] > 0, dict(c)      # plain step, draft and verify graphs
    assert all(math.isfinite(x) and x >= 0 for x in cm.plain + [x for r in cm.draft + cm.verify for x in r])


def test_cost_model_falls_back_to_eager_timing_when_replays_fail(monkeypatch):
    """A graphed path never run on this GPU must not leave the engine without a cost model."""
    from heterospec import Eagle3Draft, TargetModel
    from heterospec.graphs import RoundGraphs
    target = TargetModel.from_hf(tiny_hf_llama(seed=5))
    engine = Engine(target, Eagle3Draft.for_target(target, seed=5), config=SpecConfig(top_k=3, depth=2, total_tokens=6))
    engine.static_rounds = True
    graphs = engine.round_graphs = RoundGraphs("cpu", emulate=True)

    def broken(*a, **k):
        raise RuntimeError("capture failed")
    monkeypatch.setattr(engine, "_draft_half", broken)
    with pytest.warns(RuntimeWarning, match="timing the replayed round halves failed .*capture failed"):
        cm = costmodel.measure(engine, quick=True, repeats=1, progress=False)
    assert engine.round_graphs is graphs and cm.plain and cm.draft and cm.verify


def test_cost_model_passes_keep_each_entrys_fastest(monkeypatch):
    """A slow minute inflates the entries measured in it: with passes > 1 every entry is the
    fastest of its passes (not the faster pass as a whole)."""
    slow_then_fast = [
        dict(target=[[40.0, 41.0]], plain=[53.0, 45.0], draft=[[2.0, 1.5, 0.1], [3.0, 2.0, 0.2]],
             verify=[[57.0, 50.0], [60.0, 62.0]]),
        dict(target=[[44.0, 39.0]], plain=[40.0, 47.0], draft=[[2.5, 1.0, 0.1], [2.0, 2.5, 0.3]],
             verify=[[41.0, 52.0], [58.0, 70.0]]),
    ]
    calls = []

    def once(engine, **kw):
        calls.append(kw["desc"])
        return costmodel.CostModel(fingerprint={}, tokens=[1, 2], contexts=[256], batch_sizes=[1, 2],
                                   nodes=[1, 2], tree_top_k=4, **slow_then_fast[len(calls) - 1])

    monkeypatch.setattr(costmodel, "_measure_once", once)
    cm = costmodel.measure(object(), passes=2, progress=False)
    assert len(calls) == 2 and "pass 2/2" in calls[1]
    assert cm.target == [[39.0, 39.0]] and cm.plain == [40.0, 45.0]      # 40 > 39: a spike, lowered
    assert cm.draft == [[2.0, 1.0, 0.1], [2.0, 2.0, 0.2]] and cm.verify == [[41.0, 50.0], [58.0, 62.0]]
    assert cm.provenance["passes"] == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="passes must be an integer >= 1"):
            costmodel.measure(object(), passes=bad)


def test_cost_model_prices_are_memoized_and_a_new_field_clears_them(tmp_path):
    """Prices are asked many times a round with the same arguments; each is computed once, and
    setting any field (a new in-use factor, new curves) prices from the new values."""
    cm = costmodel.CostModel(fingerprint={}, tokens=[1, 8], contexts=[128], target=[[10.0, 17.0]],
                             batch_sizes=[1, 4], plain=[10.0, 13.0], draft=[[2.0, 1.0, 0.5], [3.0, 2.0, 1.0]],
                             nodes=[1, 8], verify=[[11.0, 18.0], [14.0, 30.0]], tree_top_k=4)
    calls = []
    compute = cm._verify_ms
    cm.__dict__["_verify_ms"] = lambda *a: calls.append(a) or compute(*a)   # (no setattr: keeps the memo)
    first = cm.verify_ms(1, 4.5, 128)
    assert cm.verify_ms(1, 4.5, 128) == first and len(calls) == 1
    assert cm.verify_ms(2, 4.5, 128) != first and len(calls) == 2
    plain = cm.plain_ms(4, 128)
    cm.in_use = {"batch_sizes": [1, 4], "round": [2.0, 2.0], "plain": [1.5, 1.5]}
    assert cm.verify_ms(1, 4.5, 128) == pytest.approx(2.0 * first) and len(calls) == 3
    assert cm.plain_ms(4, 128) == pytest.approx(1.5 * plain)
    del cm.__dict__["_verify_ms"]
    assert "_memo" not in cm.to_dict()
    cm.save(str(tmp_path / "cm.json"))
    again = costmodel.CostModel.load(str(tmp_path / "cm.json"))
    assert again.verify_ms(1, 4.5, 128) == cm.verify_ms(1, 4.5, 128)
    cm.MEMO_MAX = 4                     # a full memo starts again rather than growing
    for n in range(10):
        cm.draft_ms(1, n)
    assert len(cm._memo) <= 4


def test_cost_model_curves_interpolate():
    cm = costmodel.CostModel(fingerprint={}, tokens=[1, 8, 16], contexts=[128, 512],
                             target=[[10.0, 17.0, 25.0], [12.0, 21.0, 33.0]], batch_sizes=[1, 4],
                             plain=[10.0, 13.0], draft=[[2.0, 1.0, 0.5], [3.0, 2.0, 1.0]],
                             nodes=[1, 8], verify=[[11.0, 18.0], [14.0, 30.0]], tree_top_k=4)
    assert cm.target_ms(4.5, 128) == pytest.approx(13.5)
    assert cm.target_ms(8, 320) == pytest.approx(19.0)
    assert cm.target_ms(24, 128) == pytest.approx(33.0)          # extrapolated from the last segment
    assert cm.draft_ms(1, 3, extend_tokens=3) == pytest.approx(2.0 + 3.0 + 1.0)
    assert cm.plain_ms(4, 128) == pytest.approx(13.0)
    assert cm.verify_ms(1, 4.5, 128) == pytest.approx(14.5)
    assert cm.verify_ms(2, 1, 128) == pytest.approx(11.0 + 3.0 / 3.0)      # B interpolated
    # Longer context: scaled by the target curve's context ratio at the same tokens.
    assert cm.verify_ms(1, 8, 512) == pytest.approx(18.0 * 21.0 / 17.0)
    # A longer context measured faster (noise) is raised to the shorter's: extrapolating its
    # slope would price long contexts near zero (and every ratio to them with it).
    noisy = costmodel.CostModel(fingerprint={}, tokens=[1, 8], contexts=[32, 64],
                                target=[[10.0, 17.0], [6.0, 9.0]], batch_sizes=[1], plain=[10.0],
                                draft=[[2.0, 1.0, 0.5]], nodes=[1, 8], verify=[[11.0, 18.0]], tree_top_k=4)
    assert noisy.target_ms(1, 256) == pytest.approx(10.0) and noisy.target_ms(8, 64) == pytest.approx(17.0)
    assert noisy.plain_ms(1, 256) == pytest.approx(10.0) and noisy.verify_ms(1, 8, 256) == pytest.approx(18.0)
    # Past EXTEND_PROBE tokens an extend token costs the row's long slope (a row of three numbers,
    # from files before it: the short slope throughout).
    P = costmodel.EXTEND_PROBE
    two = costmodel.CostModel(fingerprint={}, tokens=[1, 8], contexts=[128], target=[[10.0, 17.0]], batch_sizes=[1, 4],
                              plain=[10.0, 13.0], draft=[[2.0, 1.0, 0.5, 2.0], [3.0, 2.0, 1.0, 4.0]],
                              nodes=[1, 8], verify=[[11.0, 18.0], [14.0, 30.0]], tree_top_k=4)
    assert two.draft_ms(1, 0, extend_tokens=P) == pytest.approx(2.0 + 0.5 * (P - 1))
    assert two.draft_ms(1, 0, extend_tokens=P + 10) == pytest.approx(2.0 + 0.5 * (P - 1) + 2.0 * 10)
    assert two.draft_ms(4, 1, extend_tokens=P + 10) == pytest.approx(3.0 + 2.0 + 1.0 * (P - 1) + 4.0 * 10)
    assert cm.draft_ms(1, 0, extend_tokens=P + 10) == pytest.approx(2.0 + 0.5 * (P + 9))


def test_cost_model_lowers_verify_spikes_in_every_file():
    """More verified nodes never cost less, also in a file measured before that rule: a verify
    row that priced 12 nodes below 8 (a busy minute) is read with 8 lowered to 12's time."""
    d = dict(fingerprint={}, tokens=[1, 8, 16], contexts=[256], target=[[10.0, 19.0, 18.0]], batch_sizes=[1],
             plain=[10.0], draft=[[1.0, 1.0, 0.0]], nodes=[1, 2, 4, 8, 12], verify=[[11.0, 14.0, 13.0, 16.0, 15.0]],
             tree_top_k=4)
    cm = costmodel.CostModel(**d)
    assert cm.verify == [[11.0, 13.0, 13.0, 15.0, 15.0]] and cm.target == [[10.0, 18.0, 18.0]]
    assert cm.verify_ms(1, 12) >= cm.verify_ms(1, 8) >= cm.verify_ms(1, 4) >= cm.verify_ms(1, 1)


def test_other_load_counts_other_processes_only(monkeypatch):
    """OtherLoad: the machine's busy CPU seconds minus this process's, per wall second."""
    busy, own, now = iter([100.0, 104.0]), iter([7.0, 8.0]), iter([50.0, 52.0])
    monkeypatch.setattr(costmodel.OtherLoad, "_machine_busy_s", staticmethod(lambda: next(busy)))
    monkeypatch.setattr(costmodel.OtherLoad, "_own_cpu_s", staticmethod(lambda: next(own)))
    monkeypatch.setattr(costmodel.OtherLoad, "_wall_s", staticmethod(lambda: next(now)))
    assert costmodel.OtherLoad().start().cores() == pytest.approx((4.0 - 1.0) / 2.0)
    monkeypatch.setattr(costmodel.OtherLoad, "_machine_busy_s", staticmethod(lambda: None))
    monkeypatch.setattr(costmodel.OtherLoad, "_own_cpu_s", staticmethod(lambda: 1.0))
    monkeypatch.setattr(costmodel.OtherLoad, "_wall_s", staticmethod(lambda: 1.0))
    assert costmodel.OtherLoad().start().cores() is None               # no /proc/stat: unknown


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc/stat")
def test_other_load_sees_a_busy_process():
    """A process spinning beside us for half a second shows as most of a core (the real
    /proc/stat; only the lower bound is checked - other work on the machine adds to it)."""
    import subprocess
    import sys
    load = costmodel.OtherLoad().start()
    subprocess.run([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 0.6: pass"],
                   check=True)
    assert load.cores() > costmodel.BUSY_CORES


def _quick_model(engine, busy):
    return costmodel.CostModel(
        fingerprint=costmodel.fingerprint(engine), tokens=[1, 64], contexts=[128], target=[[10.0, 12.0]],
        batch_sizes=[1], plain=[10.0], draft=[[0.01, 0.01, 0.0]], nodes=[1, 64], verify=[[10.0, 12.0]],
        tree_top_k=3, quick=True, provenance={"date": "then", "other_cores": busy})


def test_quick_cost_model_measured_on_a_busy_machine_is_measured_again(tmp_path, monkeypatch):
    """A quick model measured beside other work is measured again at the next start (and saved);
    one measured quietly, a full one or one given by path is used as it is."""
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    engine, _, _ = _tiny_engine(seed=24)
    fresh = _quick_model(engine, 0.0)
    fresh.provenance["date"] = "now"
    calls = []
    monkeypatch.setattr(costmodel, "measure", lambda eng, **kw: calls.append(kw) or fresh)
    path = costmodel.cache_path(costmodel.fingerprint(engine))
    _quick_model(engine, 1.2).save(path)
    got = costmodel.for_engine(engine, progress=False)
    assert len(calls) == 1 and got.provenance["date"] == "now"
    assert costmodel.CostModel.load(path).provenance["date"] == "now"
    for busy, quick in ((0.1, True), (1.2, False)):
        cm = _quick_model(engine, busy)
        cm.quick = quick
        cm.save(path)
        assert costmodel.for_engine(engine, progress=False).provenance["date"] == "then"
    _quick_model(engine, 1.2).save(str(tmp_path / "mine.json"))
    assert costmodel.for_engine(engine, str(tmp_path / "mine.json"), progress=False).provenance["date"] == "then"
    assert len(calls) == 1
    # Found off in use: the fitted policy's saved time correction for this very measurement.
    _quick_model(engine, 0.0).save(path)
    online = path.removesuffix(".json") + ".online-abc.json"
    # A correction at a batch the quick model never measured (it extrapolates there) is not.
    for stamp, plain_used, bucket, remeasured in (("then", 1.1, "1", False), ("earlier", 0.6, "1", False),
                                                  ("then", 0.6, "1", True), ("then", 1.4, "12", False)):
        with open(online, "w") as f:
            json.dump({"cost_model": stamp, "plain_used": {bucket: plain_used}, "time_used": {"1": 1.0}}, f)
        before = len(calls)
        costmodel.for_engine(engine, progress=False)
        assert (len(calls) > before) == remeasured, (stamp, plain_used, bucket)
        _quick_model(engine, 0.0).save(path)
    with open(online, "w") as f:
        json.dump({"cost_model": "then", "plain_used": {"1": 0.6}, "time_used": {"1": 1.0}}, f)
    cm = _quick_model(engine, 0.0)
    cm.quick = False
    cm.save(path)
    with pytest.warns(UserWarning, match=r"found off in use \(observed / predicted step time 0.60\).*heterospec costs"):
        assert costmodel.for_engine(engine, progress=False).provenance["date"] == "then"


def test_measure_reports_a_busy_machine(monkeypatch):
    """``measure`` records the cores other processes used and warns above BUSY_CORES."""
    engine, _, _ = _tiny_engine(seed=25)
    monkeypatch.setattr(costmodel, "_measure_once", lambda eng, **kw: _quick_model(eng, None))
    for cores, warns in ((1.4, True), (0.05, False)):
        monkeypatch.setattr(costmodel.OtherLoad, "cores", lambda self, c=cores: c)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            cm = costmodel.measure(engine, progress=False)
        assert cm.provenance["other_cores"] == cores and cm.busy == cores
        assert any("1.4 CPU cores busy" in str(w.message) for w in rec) == warns


def test_online_time_corrections_reset_when_the_cost_model_was_measured_again():
    """The time scales and the guard's sums correct one measurement of the device; a state saved
    with another keeps only what it learnt about acceptance."""
    tables = _tables()
    old, new = LinearCost(), LinearCost()
    old.provenance, new.provenance = {"date": "monday"}, {"date": "tuesday"}
    cfg = SpecConfig(top_k=4, depth=3, total_tokens=8)
    pol = FittedPolicy(tables, old, cfg)
    plan = pol.plan(1)
    for _ in range(12):
        pol.observe(plan, [0], [1], 0.05)
    state = json.loads(json.dumps(pol.state()))
    assert state["time"] and state["realized"] and state["cost_model"] == "monday"
    same = FittedPolicy(tables, old, cfg)
    same.load_state(state)
    assert same.state()["time"] == state["time"] and same.state()["realized"] == state["realized"]
    other = FittedPolicy(tables, new, cfg)
    other.load_state(state)
    got = other.state()
    assert got["time"] == {} and got["realized"] == {} and got["time_used"] == {}
    assert got["position"] == state["position"] and got["bin_accept"] == state["bin_accept"]


# ---------------------------------------------------------------------------------------------
# Engine: batched rounds with requests in different bins
# ---------------------------------------------------------------------------------------------
class FixedPolicy(Policy):
    """One plan per batch size (tests)."""

    name = "fixed"

    def __init__(self, plans):
        self.plans = plans

    def plan(self, batch_size, context=None):
        return self.plans.get(batch_size, self.plans[max(self.plans)])


def _mixed_plan(edge):
    # Bin 0 (easy): 4 forwards, 6 draft nodes; bin 1: no extension, 2 nodes; bin 2: root only.
    return Plan("mixed", decide_depth=1, entropy_k=3, edges=[edge, edge + 0.6], depth=[4, 1, 1], budget=[6, 2, 0])


def _prompts(vocab, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _edge_at_median(engine, draft, prompts):
    """An entropy edge that splits the rounds of these prompts (so a batch mixes bins)."""
    draft.set_prompts(prompts)
    res = engine.generate_batch(prompts, max_new_tokens=12, method="heterospec", policy=FixedPolicy(
        {1: Plan("probe", decide_depth=1, entropy_k=3, edges=[], depth=[1], budget=[4])}), chat=False)
    ent = sorted(r.entropy for x in res for r in x.stats.records)
    return ent[len(ent) // 3]


@pytest.mark.parametrize("noise", [0.7, 2.0])
def test_batched_round_with_different_bins_is_greedy_lossless(noise):
    hf = tiny_hf_llama(seed=31)
    draft = OracleDraft(hf, noise=noise, seed=4)
    engine = Engine(hf, draft, config=SpecConfig(top_k=3, depth=1, total_tokens=5))
    prompts = _prompts(hf.config.vocab_size, 6, seed=int(noise > 1))
    edge = _edge_at_median(engine, draft, prompts)
    # Batches of 6, 5, ... speculate with mixed bins; at 3 or fewer requests a round is plain.
    policy = FixedPolicy({**{b: _mixed_plan(edge) for b in range(4, 7)},
                          **{b: Plan("plain", speculate=False, decide_depth=0, entropy_k=3, edges=[], depth=[0],
                                     budget=[0]) for b in range(1, 4)}})
    draft.set_prompts(prompts)
    spec = engine.generate_batch(prompts, max_new_tokens=24, method="heterospec", policy=policy, chat=False)
    draft.set_prompts(prompts)
    ar = engine.generate_batch(prompts, max_new_tokens=24, method="autoregressive", chat=False)
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    # Some round held requests of different bins, with their own depth and budget.
    per_round = list(itertools.zip_longest(*[[r for r in x.stats.records] for x in spec]))
    mixed = [rs for rs in per_round if len({r.bin for r in rs if r is not None and not r.plain}) > 1]
    assert mixed, "no batched round mixed entropy bins"
    for x in spec:
        for r in x.stats.records:
            if not r.plain:
                assert (r.depth, r.verified <= [7, 3, 1][r.bin]) == ([5, 2, 2][r.bin], True)
    assert sum(r.accept_len for x in spec for r in x.stats.records) > 0
    assert any(r.plain for x in spec for r in x.stats.records)          # the tail decoded plainly


def test_fitted_policy_from_calibration_is_greedy_lossless(tmp_path):
    engine, draft, hf = _tiny_engine(seed=23)
    engine.draft_dir = tmp_path
    prompts = [[5 + i, 9, 17 + i, 33] for i in range(8)]
    draft.set_prompts(prompts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tables, bins = calibrate_policy(engine, prompts, max_new_tokens=16, progress=False, batch_size=8,
                                        out_dir=str(tmp_path))
    assert AcceptanceTables.find(str(tmp_path)).to_dict() == tables.to_dict()
    assert EntropyBins.load(str(tmp_path / "entropy_bins.json")).edges == bins.edges
    rounds = tables.provenance["rounds"]
    assert rounds >= 16 and all(sum(o.counts) == rounds for o in tables.options)
    # At a fixed depth, verifying more nodes (a superset) never accepts less. (Drafting deeper at a
    # fixed N can: deeper candidates may displace a shallow sibling that would have been accepted.)
    for o in tables.options:
        for b, tab in enumerate(o.accept):
            if o.counts[b]:
                t = torch.tensor(tab)
                assert (t[:, 1:] >= t[:, :-1] - 1e-9).all() and (t[:, 0] == 0).all()
    # A cost model where drafting is nearly free: the fitted plan speculates, and stays lossless.
    engine.cost_model = costmodel.CostModel(
        fingerprint=costmodel.fingerprint(engine), tokens=[1, 64], contexts=[128], target=[[10.0, 12.0]],
        batch_sizes=[1], plain=[10.0], draft=[[0.01, 0.01, 0.0]], nodes=[1, 64], verify=[[10.0, 12.0]],
        tree_top_k=3)
    policy = engine._policy("heterospec", engine.config, "fitted")
    plan = policy.plan(1)
    assert isinstance(policy, FittedPolicy) and plan.speculate
    policy.PROBE_EVERY = 10 ** 9        # no probe rounds of plain decoding in this check
    policy.EARLY_PLAIN_PROBES = ()      # (so the realized-throughput guard has no plain steps either)
    policy.MIN_ROUNDS = 10 ** 9         # nor the time corrections: a busy machine's slow rounds priced plain
    for p in prompts[:3]:
        draft.set_prompts([p])
        ar = engine.generate(p, max_new_tokens=20, method="autoregressive", chat=False)
        draft.set_prompts([p])
        hs = engine.generate(p, max_new_tokens=20, method="heterospec", chat=False)
        assert hs.token_ids == ar.token_ids
        assert all(not r.plain for r in hs.stats.records)
    # The held-out check: the tables' plans on other prompts, every round speculative, without
    # touching the tables; what they accepted over what they predicted, per position.
    others = [[40 + i, 9, 61 + i, 33, 2] for i in range(6)]
    before = tables.to_dict()
    held = measure_held_out(engine, tables, others, max_new_tokens=24, progress=False, chat=False)
    assert tables.to_dict() == before and held["prompts"] == 6 and held["max_new_tokens"] == 24
    scale, predicted = held["position_scale"], held["predicted"]
    assert scale and len(scale) == len(predicted) and all(p >= FittedPolicy.MIN_OBSERVED for p in predicted)
    assert all(x >= 0.0 for x in scale)
    held_tables = AcceptanceTables.from_dict({**tables.to_dict(), "held_out": held})
    assert FittedPolicy(held_tables, engine.cost_model, engine.config).position_scale()[0] == \
        pytest.approx(round(scale[0] / 0.05) * 0.05)
    with pytest.raises(ValueError, match="no held-out prompts"):
        measure_held_out(engine, tables, [], progress=False)


class _Scripted(Policy):
    """A policy whose answer to ``plan`` is ``plan`` and whose n-th round (from 1) runs
    ``rounds(n)``: plans that change within a call, as the fitted policy's probes do."""
    name = "scripted"

    def __init__(self, plan, rounds):
        self._plan, self._rounds, self.n = plan, rounds, 0

    def plan(self, batch_size, context=None):
        return self._plan

    def needs_draft(self, batch_size):
        return True

    def round_plan(self, batch_size, context=None, tokens_left=None, catchup=None, timed=True):
        self.n += 1
        return self._rounds(self.n)


def test_plain_stretches_between_rounds_are_greedy_lossless():
    """Plain steps inside a speculative call (probes, guard, plain plans) queue the draft's
    pending extend (growing its buffer past the prompt); the next round drafts from all of it.
    Batches of requests with different prompt lengths, stretches of 1-7 plain steps."""
    engine, draft, hf = _tiny_engine(seed=29)
    prompts = _prompts(hf.config.vocab_size, 4, seed=8)
    edge = _edge_at_median(engine, draft, prompts)
    spec = _mixed_plan(edge)
    plain = Plan("plain", speculate=False, decide_depth=0, entropy_k=3, edges=[], depth=[0], budget=[0], binned=False)

    draft.set_prompts(prompts)
    ar = engine.generate_batch(prompts, max_new_tokens=40, method="autoregressive", chat=False)
    draft.set_prompts(prompts)
    hs = engine.generate_batch(prompts, max_new_tokens=40, method="heterospec", policy=_Scripted(spec, lambda n: spec if n % 8 in (0, 3) else plain), chat=False)
    assert [r.token_ids for r in hs] == [r.token_ids for r in ar]
    recs = [r for x in hs for r in x.stats.records]
    assert any(r.plain for r in recs) and any(not r.plain and r.accept_len > 0 for r in recs)


def _spy_extends(draft):
    """Wrap ``draft.extend``; the list returned gets ``(prefix_lens, num_new, hole)`` of every
    call (cloned; hole None when the call had none)."""
    calls = []
    extend = draft.extend

    def spy(input_ids, features, cache, prefix_lens, num_new, hole=None):
        calls.append((prefix_lens.clone(), num_new.clone(), None if hole is None else hole.clone()))
        return extend(input_ids, features, cache, prefix_lens, num_new, hole)

    draft.extend = spy
    return calls


def test_long_plain_stretches_keep_a_window_of_the_draft_catch_up():
    """With draft_window 2, a request's pending extend never holds more than 4 entries: plain
    stretches of 9 steps drop the oldest entries and leave a hole in the draft's context. The
    output is the target's either way (greedy identical to autoregressive); without the window
    the catch-up spans the whole stretch."""
    engine, draft, hf = _tiny_engine(seed=29)
    prompts = _prompts(hf.config.vocab_size, 3, seed=8)
    spec = _mixed_plan(_edge_at_median(engine, draft, prompts))
    plain = Plan("plain", speculate=False, decide_depth=0, entropy_k=3, edges=[], depth=[0], budget=[0], binned=False)
    seen = _spy_extends(draft)
    draft.set_prompts(prompts)
    ar = engine.generate_batch(prompts, max_new_tokens=40, method="autoregressive", chat=False)
    widths = {}
    for window in (2, None):
        engine.draft_window, seen[:] = window, []
        draft.set_prompts(prompts)
        hs = engine.generate_batch(prompts, max_new_tokens=40, method="heterospec",
                                   policy=_Scripted(spec, lambda n: spec if n % 10 == 0 else plain), chat=False)
        assert [r.token_ids for r in hs] == [r.token_ids for r in ar]
        assert any(not r.plain and r.accept_len > 0 for x in hs for r in x.stats.records)
        rounds = seen[1:]                        # seen[0]: the prompt, extended at prefill
        widths[window] = max(int(n.max()) for _, n, _ in rounds)
        holes = [h for _, _, h in rounds if h is not None and bool((h[:, 1] > h[:, 0]).any())]
        assert bool(holes) == (window is not None)
    assert widths[2] <= 4 < widths[None]
    for bad in (0, -3, 2.5, True, "16"):
        with pytest.raises(ValueError, match="draft_window"):
            engine.draft_window = bad
    assert engine.draft_window is None


class _ScriptedCold(_Scripted):
    """A scripted policy whose plain stretches declare how many plain rounds follow (the probe
    schedule's ``plain_rounds_ahead``): the engine runs their steps cold."""

    def __init__(self, plan, rounds, period):
        super().__init__(plan, rounds)
        self.period = period

    def plain_rounds_ahead(self, batch_size):
        return (-self.n) % self.period - 1 if self.n % self.period else 0


def test_cold_plain_steps_keep_one_pending_entry_and_stay_greedy_lossless():
    """Plain rounds that the policy says are followed by draft_window more plain rounds run
    cold: the pending extend keeps only the newest entry (the rest join the request's hole), the
    last draft_window plain steps before a round are warm again, and the output is the target's
    (greedy identical to autoregressive) at batch 1 and 3, with rounds after cold stretches
    still accepting drafts."""
    engine, draft, hf = _tiny_engine(seed=29)
    engine.draft_window = 3
    seen = _spy_extends(draft)
    for n_prompts in (1, 3):
        prompts = _prompts(hf.config.vocab_size, n_prompts, seed=8)
        spec = _mixed_plan(_edge_at_median(engine, draft, prompts))
        plain = Plan("plain", speculate=False, decide_depth=0, entropy_k=3, edges=[], depth=[0], budget=[0],
                     binned=False)
        draft.set_prompts(prompts)
        ar = engine.generate_batch(prompts, max_new_tokens=60, method="autoregressive", chat=False)
        period = 6
        pol = _ScriptedCold(spec, lambda n: spec if n % period == 0 else plain, period)
        seen[:] = []
        draft.set_prompts(prompts)
        hs = engine.generate_batch(prompts, max_new_tokens=60, method="heterospec", policy=pol, chat=False)
        assert [r.token_ids for r in hs] == [r.token_ids for r in ar]
        recs = [r for x in hs for r in x.stats.records]
        assert any(not r.plain and r.accept_len > 0 for r in recs)
        rounds = seen[1:]                       # seen[0]: the prompt, extended at prefill
        # 5 plain steps before each round: 2 cold, the last 3 warm, so a round catches up on
        # 3 + 1 entries (one of them the cold stretch's newest), not on the whole stretch
        assert max(int(n.max()) for _, n, _ in rounds) == engine.draft_window + 1
        holes = [h for _, _, h in rounds if h is not None and bool((h[:, 1] > h[:, 0]).any())]
        assert holes, "cold steps leave a hole in the draft's context"
    # no window: no cold steps (the window is what makes dropping those entries harmless)
    engine.draft_window = None
    prompts = _prompts(hf.config.vocab_size, 2, seed=8)
    seen[:] = []
    draft.set_prompts(prompts)
    engine.generate_batch(prompts, max_new_tokens=30, method="heterospec",
                          policy=_ScriptedCold(spec, lambda n: spec if n % 12 == 0 else plain, 12), chat=False)
    assert all(h is None for _, _, h in seen)


def test_a_chain_of_cold_steps_leaves_the_draft_state_a_full_cold_step_would():
    """Consecutive cold steps move only the hole's end (Engine._cold_step): after each step the
    hole, the draft length and the pending entry equal those of a batch whose every cold step
    took the full path, and a batch whose draft tensors were replaced in between (a round, a
    compaction) takes the full path again."""
    from heterospec.config import SamplingParams
    engine, draft, hf = _tiny_engine(seed=29)
    prompts = _prompts(hf.config.vocab_size, 3, seed=8)
    params = SamplingParams()
    draft.set_prompts(prompts)
    ids = [list(p) for p in prompts]
    cache_len = max(len(p) for p in ids) + 40
    with torch.inference_mode():
        chain, full = (engine._prefill(ids, "heterospec", params, None, cache_len, 100, None, True,
                                       defer_prompt=True) for _ in range(2))
        names = ("draft_hole", "draft_lens", "ext_tokens", "ext_feats", "ext_num", "prefix_lens", "root")
        for step in range(8):
            if step == 5:      # a replaced draft tensor ends the chain: the full path again
                chain.ext_num = chain.ext_num.clone()
            hole_before = chain.draft_hole
            full.cold_tail = None
            for st in (chain, full):
                engine._decode_one(st, params, 100, None, cold=True)
            assert (chain.draft_hole is hole_before) == (step not in (0, 5))
            for name in names:
                assert torch.equal(getattr(chain, name), getattr(full, name)), (step, name)
            assert bool((chain.draft_hole[:, 1] == chain.prefix_lens - 1).all())
            assert bool((chain.draft_lens == chain.prefix_lens - 1).all()) and chain.ext_tokens.shape[1] == 1


def _starts_plain():
    """A tiny engine (draft window 2), 3 prompts, a speculative plan and a plain one whose
    alternative it is: a call planned plain that drafts when the script says so."""
    engine, draft, hf = _tiny_engine(seed=29)
    engine.draft_window = 2
    prompts = _prompts(hf.config.vocab_size, 3, seed=8)
    spec = _mixed_plan(_edge_at_median(engine, draft, prompts))
    plain = Plan("plain", speculate=False, decide_depth=0, entropy_k=3, edges=[], depth=[0], budget=[0], binned=False,
                 alternative=spec)
    return engine, draft, prompts, spec, plain


def test_a_call_that_starts_plain_defers_the_draft_prompt_pass_to_its_first_drafted_round():
    """Where the plan at the call's batch size is plain, the draft's pass over the prompts runs
    at the start of the first round that drafts (slots from 0, before the hole of the cold steps
    in between), over the rows still running, and not at all in a call that stays plain; the
    output is the target's either way (greedy identical to autoregressive)."""
    engine, draft, prompts, spec, plain = _starts_plain()
    calls = _spy_extends(draft)
    draft.set_prompts(prompts)
    ar = engine.generate_batch(prompts, max_new_tokens=50, method="autoregressive", chat=False)
    for first_round, period in ((6, 6), (10 ** 6, 6)):
        calls[:] = []
        draft.set_prompts(prompts)
        pol = _ScriptedCold(plain, lambda n: spec if n >= first_round and n % period == 0 else plain, period)
        hs = engine.generate_batch(prompts, max_new_tokens=50, method="heterospec", policy=pol, chat=False)
        assert [r.token_ids for r in hs] == [r.token_ids for r in ar]
        if first_round > 50:
            assert calls == []                  # plain throughout: the draft never ran
            continue
        assert calls and (calls[0][0] == 0).all()
        # the rows still running at the first round (one request ended earlier, and its row left)
        running = [len(p) - 1 for p, r in zip(prompts, hs) if len(r.token_ids) > first_round]
        assert calls[0][1].tolist() == running and len(running) < len(prompts)
        assert all((c[0] > 0).all() for c in calls[1:])
        assert any(not r.plain and r.accept_len > 0 for x in hs for r in x.stats.records)
    # a call whose plan speculates from the start extends the prompts at prefill, as before
    calls[:] = []
    draft.set_prompts(prompts)
    engine.generate_batch(prompts, max_new_tokens=4, method="heterospec", policy=FixedPolicy({3: spec}), chat=False)
    assert calls and calls[0][1].tolist() == [len(p) - 1 for p in prompts]


def test_engine_tells_the_policy_the_rounds_left_and_the_draft_s_catch_up():
    """Each round the engine passes ``round_plan`` the tokens its slowest running request still
    has to go and a callable for the tokens per request the draft would first catch up on: in a
    call that started plain, the deferred prompt pass (prompt length - 1 per running row) plus
    the pending entry; after a drafted round, only what that round accepted."""
    engine, draft, prompts, spec, plain = _starts_plain()
    seen = []

    class Spy(_ScriptedCold):
        def round_plan(self, batch_size, context=None, tokens_left=None, catchup=None, timed=True):
            seen.append((batch_size, tokens_left, catchup()))
            return super().round_plan(batch_size, context)

    draft.set_prompts(prompts)
    ar = engine.generate_batch(prompts, max_new_tokens=50, method="autoregressive", chat=False)
    draft.set_prompts(prompts)
    pol = Spy(plain, lambda n: spec if n % 6 == 0 else plain, 6)
    hs = engine.generate_batch(prompts, max_new_tokens=50, method="heterospec", policy=pol, chat=False)
    assert [r.token_ids for r in hs] == [r.token_ids for r in ar]
    assert seen[0][:2] == (3, 49)                 # prefill emitted each request's first token
    assert seen[0][2] == pytest.approx(sum(len(p) - 1 for p in prompts) / 3 + 1)
    lefts = [left for _, left, _ in seen]
    assert all(a > b for a, b in zip(lefts, lefts[1:]))      # the slowest request moves every round
    after = seen[6][2]                            # the round after the first drafted one (round 6)
    assert 1 <= after <= spec.max_depth + 2       # its accepted path, no prompt any more


def test_the_round_that_runs_the_deferred_prompt_pass_tells_the_policy_its_measured_seconds():
    """A call that starts plain runs the draft's prompt pass in its first drafted round: the
    engine times that pass and hands it to ``observe`` as the round's one-off seconds, with the
    catch-up tokens less the prompt's (they are not priced again); the rounds after it have
    none. The output is the target's."""
    engine, draft, prompts, spec, plain = _starts_plain()
    seen = []

    class Spy(_ScriptedCold):
        def round_plan(self, batch_size, context=None, tokens_left=None, catchup=None, timed=True):
            self.catchup = catchup()
            return super().round_plan(batch_size, context)

        def observe(self, plan, bins, accepted, seconds=None, extend_tokens=None, one_off_s=0.0, **kw):
            if plan.speculate:
                seen.append((self.n, self.catchup, extend_tokens, one_off_s, seconds))

    draft.set_prompts(prompts)
    ar = engine.generate_batch(prompts, max_new_tokens=40, method="autoregressive", chat=False)
    draft.set_prompts(prompts)
    hs = engine.generate_batch(prompts, max_new_tokens=40, method="heterospec",
                               policy=Spy(plain, lambda n: spec if n % 6 == 0 else plain, 6), chat=False)
    assert [r.token_ids for r in hs] == [r.token_ids for r in ar]
    assert len(seen) >= 2 and seen[0][0] == 6
    n, catchup, extend, one_off, seconds = seen[0]
    assert 0.0 < one_off < seconds
    running = [len(p) - 1 for p, r in zip(prompts, hs) if len(r.token_ids) > n]   # (rows still there)
    assert extend == pytest.approx(catchup - sum(running) / len(running))
    assert 1 <= extend <= engine.draft_window + 1          # the pending entries of the warm steps
    assert all(o == 0.0 and e == c for _, c, e, o, _ in seen[1:])


def test_a_round_switches_to_speculation_only_where_the_rounds_left_repay_the_draft_s_catch_up():
    """A speculating bucket whose draft is behind (a call that ran plainly: a deferred prompt
    pass, a plain stretch) speculates only if the model's saving per round, over the rounds its
    slowest request has left, pays for the catch-up the cost model prices; a steady round (no
    excess catch-up) speculates whatever is left, and without the engine's hints the plan is
    as before."""
    policy = FittedPolicy(_tables(easy_accept=0.7), ExtendCost(a=10.0, b=1.0, c=0.5, e=0.5),
                          SpecConfig(top_k=4, depth=1, total_tokens=4))
    policy.EARLY_PLAIN_PROBES = ()
    spec = policy.plan(1)
    assert spec.speculate
    exp = spec.expected
    per_round = exp["speculative"]["tokens"]
    saved_ms = per_round * exp["plain"]["ms"] - exp["speculative"]["ms"]
    assert saved_ms > 0
    behind = per_round + 40.0                           # 40 tokens beyond a steady round: 20 ms
    catch_ms = 0.5 * 40.0
    need = catch_ms / saved_ms * per_round              # tokens left at which it breaks even
    assert 2 < need < 500
    assert not policy.round_plan(1, tokens_left=int(need) - 1, catchup=lambda: behind).speculate
    assert policy.round_plan(1, tokens_left=int(need) + 1, catchup=lambda: behind).speculate
    assert policy.round_plan(1, tokens_left=1, catchup=lambda: per_round).speculate     # steady
    assert policy.round_plan(1, tokens_left=1).speculate and policy.round_plan(1).speculate


def test_a_probe_burst_waits_for_a_call_with_a_burst_s_rounds_left_and_is_priced_with_its_catch_up():
    """A plain bucket's probe due near the end of a call (fewer tokens left than a burst has
    rounds) waits - ``plain_rounds_ahead`` 0 meanwhile, so the steps before it stay warm - and
    comes with the first round that has room. The catch-up that burst paid (taken off its
    rounds' times, which judge steady speculation) prices the spacing to the next probe."""
    policy = FittedPolicy(_tables(easy_accept=0.7), ExtendCost(a=10.0, b=4.0, c=4.0, e=4.0),
                          SpecConfig(top_k=4, depth=1, total_tokens=4))
    plan = policy.plan(1)
    assert not plan.speculate and plan.alternative is not None
    every = policy._probe_spacing(1, plan)
    for _ in range(every - 1):
        assert not policy.round_plan(1, tokens_left=100).speculate
    for left in range(policy.PROBE_BURST - 1, 0, -1):             # due, but the call is ending
        assert not policy.round_plan(1, tokens_left=left).speculate
        assert policy.plain_rounds_ahead(1) == 0
    steady = plan.alternative.expected["speculative"]["tokens"]
    first = policy.round_plan(1, tokens_left=90)                   # the next call: room for a burst
    assert first.speculate
    policy.observe(first, [0], [1], seconds=0.060, extend_tokens=steady + 40)   # 20 ms of catch-up
    for _ in range(policy.PROBE_BURST - 1):
        p = policy.round_plan(1, tokens_left=80)
        if p.speculate:
            policy.observe(p, [0], [1], seconds=0.040, extend_tokens=p.expected["speculative"]["tokens"])
    for _ in range(8):
        policy.observe(plan, [], [], seconds=0.014)
    recent = policy._recent_spec[1]
    assert recent[0][2] == pytest.approx(0.020) and all(r[2] == 0.0 for r in recent[1:])
    without = sum(r[1] - r[0] * 0.014 for r in recent) / len(recent) * policy.PROBE_BURST
    assert policy._measured_probe_loss(1) == pytest.approx(
        (without + 0.020) / (policy.PROBE_LOSS_SHARE * 0.014), rel=1e-3)


def test_fitted_policy_tells_how_many_plain_rounds_its_probe_schedule_has_left():
    """``plain_rounds_ahead`` after a plain round of a plain bucket counts the plain rounds left
    before its next probe burst; after a speculative round, a speculating bucket's plain probe
    or inside a burst it is 0."""
    policy = FittedPolicy(_tables(easy_accept=0.7), LinearCost(a=10.0, b=1.0, c=4.0, e=4.0),
                          SpecConfig(top_k=4, depth=1, total_tokens=4))
    assert not policy.plan(1).speculate and policy.plan(1).alternative is not None
    kinds, ahead = [], []
    for _ in range(3 * policy.PROBE_EVERY):
        kinds.append(policy.round_plan(1).speculate)
        ahead.append(policy.plain_rounds_ahead(1))
    for i, k in enumerate(kinds):
        if k:
            assert ahead[i] == 0
        else:
            nxt = kinds.index(True, i) if True in kinds[i:] else None
            if nxt is not None:
                assert ahead[i] == nxt - i - 1, (i, ahead[i], nxt)
    assert sum(kinds) >= policy.PROBE_BURST
    # a speculating bucket: never cold, its plain probes included
    fast = FittedPolicy(_tables(easy_accept=0.7), LinearCost(a=10.0, b=1.0, c=0.5, e=0.5),
                        SpecConfig(top_k=4, depth=1, total_tokens=4))
    assert fast.plan(1).speculate
    got = [(fast.round_plan(1).speculate, fast.plain_rounds_ahead(1)) for _ in range(70)]
    assert any(not k for k, _ in got) and all(a == 0 for _, a in got)
    assert Policy().plain_rounds_ahead(4) == 0


def test_cache_covers_speculative_probes_of_a_plain_plan():
    """A call that starts under a plain plan (the guard, a plain bucket) may still run
    speculative probe rounds, up to the end of max_new_tokens: the KV caches are sized for
    every plan the policy may return (Policy.max_tree_nodes), not for the plans at the start."""
    engine, draft, hf = _tiny_engine(seed=31)
    prompts = _prompts(hf.config.vocab_size, 2, seed=9)
    spec = Plan("wide", decide_depth=1, entropy_k=3, edges=[], depth=[3], budget=[6])
    plain = Plan("plain", speculate=False, decide_depth=0, entropy_k=3, edges=[], depth=[0], budget=[0],
                 binned=False, alternative=spec)

    pol = _Scripted(plain, lambda n: spec if n % 2 == 0 else plain)
    assert pol.max_tree_nodes(2) == 6
    draft.set_prompts(prompts)
    ar = engine.generate_batch(prompts, max_new_tokens=30, method="autoregressive", chat=False)
    draft.set_prompts(prompts)
    hs = engine.generate_batch(prompts, max_new_tokens=30, method="heterospec", policy=pol, chat=False)
    assert [r.token_ids for r in hs] == [r.token_ids for r in ar]
    # the fitted policy covers its whole action grid
    tables = _tables()
    fitted = FittedPolicy(tables, LinearCost(), SpecConfig(top_k=4, depth=1, total_tokens=4))
    assert fitted.max_tree_nodes(1) == max(NODES) - 1
    assert FittedPolicy(tables, LinearCost(), SpecConfig(top_k=4, depth=1, total_tokens=4),
                        max_nodes=5).max_tree_nodes(4) == 5


def test_sampling_with_mixed_bins_keeps_the_target_law():
    from tests.test_sampling_lossless import NEW, PROMPT, REQUESTS, _engine, assert_samples_follow_law, exact_law
    from heterospec.config import SamplingParams

    engine, hf = _engine("oracle")
    probe = engine.generate_batch([PROMPT] * 64, max_new_tokens=NEW, method="heterospec", temperature=1.0,
                                  seed=7, chat=False, policy=FixedPolicy(
                                      {b: Plan("probe", decide_depth=1, entropy_k=3, edges=[], depth=[1], budget=[4])
                                       for b in (64,)}))
    ent = sorted(r.entropy for x in probe for r in x.stats.records)
    plan = _mixed_plan(ent[len(ent) // 3])
    res = engine.generate_batch([PROMPT] * REQUESTS, max_new_tokens=NEW, method="heterospec", temperature=1.0,
                                seed=2025, chat=False, policy=FixedPolicy({REQUESTS: plan}))
    bins = {r.bin for x in res for r in x.stats.records}
    assert len(bins) >= 2, bins
    assert_samples_follow_law(res, exact_law(hf, SamplingParams(temperature=1.0)))


def test_sampling_after_a_cold_plain_step_keeps_the_target_law():
    """A call that starts plain (the draft's prompt pass deferred to the first drafted round),
    a cold plain step (its pending entries join the hole) and at once a speculative round (a
    plain stretch that ended sooner than the policy said: the guard turned, the batch shrank):
    the round drafts from the prompt and the newest entry, and the samples follow the target law."""
    from tests.test_sampling_lossless import NEW, PROMPT, REQUESTS, _engine, assert_samples_follow_law, exact_law
    from heterospec.config import SamplingParams

    engine, hf = _engine("oracle")
    engine.draft_window = 1
    spec = Plan("probe", decide_depth=1, entropy_k=3, edges=[], depth=[1], budget=[4])
    plain = Plan("plain", speculate=False, decide_depth=0, entropy_k=3, edges=[], depth=[0], budget=[0], binned=False,
                 alternative=spec)

    class ColdThenSpeculate(_Scripted):
        def plain_rounds_ahead(self, batch_size):
            return 1 if self.n == 1 else 0

    calls = _spy_extends(engine.draft)
    res = engine.generate_batch([PROMPT] * REQUESTS, max_new_tokens=NEW, method="heterospec", temperature=1.0,
                                seed=2026, chat=False,
                                policy=ColdThenSpeculate(plain, lambda n: plain if n == 1 else spec))
    # the call starts plain: the prompt pass runs in the first round, then the newest entry past the hole
    holes = [h is not None and bool((h[:, 1] > h[:, 0]).all()) for _, _, h in calls]
    assert len(holes) == 2 and not holes[0] and holes[1]
    assert all(x.stats.records[0].plain and not x.stats.records[1].plain for x in res)
    assert_samples_follow_law(res, exact_law(hf, SamplingParams(temperature=1.0)))


# ---------------------------------------------------------------------------------------------
# Ragged verification
# ---------------------------------------------------------------------------------------------
def test_ragged_verification_gives_the_padded_logits():
    from heterospec import TargetModel, ops

    hf = tiny_hf_llama(seed=41)
    target = TargetModel.from_hf(hf)
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 6, hf.config.vocab_size
    num = torch.tensor([6, 1, 3])
    parents = torch.full((B, T), -1, dtype=torch.int64)
    for b in range(B):
        for i in range(1, int(num[b])):
            parents[b, i] = int(torch.randint(0, i, (1,), generator=g))
    prefix = torch.tensor([5, 9, 7])
    mask, pos, _, _ = ops.build_tree(parents, num, prefix)
    toks = torch.randint(0, V, (B, T), generator=g)
    prompt = torch.randint(0, V, (B, 9), generator=g)
    out = {}
    for ragged in (False, True):
        cache = target.new_cache(B, 32)
        zero = torch.zeros(B, dtype=torch.int64)
        with torch.inference_mode():
            target(prompt, torch.arange(9)[None].expand(B, 9), cache, zero, None, None, return_features=False)
            out[ragged] = target(toks, pos, cache, prefix, mask, num, return_features=True, ragged=ragged)
    for b in range(B):
        n = int(num[b])
        torch.testing.assert_close(out[True][0][b, :n], out[False][0][b, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[True][1][b, :n], out[False][1][b, :n], rtol=1e-5, atol=1e-5)
        assert (out[True][0][b, n:] == 0).all()


def test_ragged_prefill_gives_the_padded_logits_features_and_cache():
    """The engine's prefill runs ragged on CPU (prompts of different lengths, the linear layers
    on the real tokens only): the last real token's logits, the real rows' features and the
    cache entries of the real positions are the padded forward's; logits_index must name real
    rows there."""
    from heterospec import TargetModel

    hf = tiny_hf_llama(seed=43)
    target = TargetModel.from_hf(hf)
    g = torch.Generator().manual_seed(1)
    B, T, V = 3, 7, hf.config.vocab_size
    lens = torch.tensor([7, 2, 5])
    toks = torch.randint(0, V, (B, T), generator=g)
    pos = torch.arange(T).expand(B, T)
    zero = torch.zeros(B, dtype=torch.int64)
    out, caches = {}, {}
    for ragged in (False, True):
        caches[ragged] = target.new_cache(B, 16)
        with torch.inference_mode():
            out[ragged] = target(toks, pos, caches[ragged], zero, None, lens, return_features=True,
                                 logits_index=(lens - 1)[:, None], ragged=ragged)
    assert out[True][0].shape == out[False][0].shape == (B, 1, V)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-5)
    for b in range(B):
        n = int(lens[b])
        torch.testing.assert_close(out[True][1][b, :n], out[False][1][b, :n], rtol=1e-5, atol=1e-5)
        for kv in ("k", "v"):        # [layers, B, S, kv heads, head dim]
            torch.testing.assert_close(getattr(caches[True], kv)[:, b, :n], getattr(caches[False], kv)[:, b, :n],
                                       rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="logits_index must name real rows"):
        target(toks, pos, target.new_cache(B, 16), zero, None, lens, return_features=False,
               logits_index=torch.full((B, 1), T - 1), ragged=True)


def test_ragged_and_padded_batches_decode_the_same():
    hf = tiny_hf_llama(seed=31)
    draft = OracleDraft(hf, noise=0.7, seed=4)
    engine = Engine(hf, draft, config=SpecConfig(top_k=3, depth=1, total_tokens=5))
    prompts = _prompts(hf.config.vocab_size, 5, seed=3)
    edge = _edge_at_median(engine, draft, prompts)
    policy = FixedPolicy({b: _mixed_plan(edge) for b in range(1, 6)})
    outs = {}
    for ragged in (True, False):
        engine.ragged_verify = ragged
        draft.set_prompts(prompts)
        outs[ragged] = engine.generate_batch(prompts, max_new_tokens=16, method="heterospec", policy=policy,
                                             chat=False)
    assert [r.token_ids for r in outs[True]] == [r.token_ids for r in outs[False]]
    assert [[(x.accept_len, x.verified) for x in r.stats.records] for r in outs[True]] == \
           [[(x.accept_len, x.verified) for x in r.stats.records] for r in outs[False]]


def _as_predicted(plan, b, r, n):
    """Accepted drafts of round ``r`` of ``n`` in bin ``b`` such that the ``n`` rounds together
    accept exactly as the plan's tables predict: position j is accepted in the first
    round(n * P(accepted >= j)) rounds (stratified, no randomness)."""
    return sum(1 for sj in plan.survival[b] if r < round(n * sj))


def test_fitted_policy_learns_the_workloads_acceptance():
    """Rounds that accept less than the tables predict lower the expected tokens; with a device
    where speculation barely pays, the policy then turns it off (and back on when it recovers)."""
    # verifying two or more tokens costs 1.4x a one-token step
    tables, cost = _tables(easy_accept=0.7), StepCost(verify_two=14.0, draft=(0.5, 0.5))
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    first = policy.plan(1)
    assert first.speculate and policy.position_scale() == (1.0,) * len(policy.position_scale())
    margin_scale = fit_plan(tables, cost, 1).expected
    easy = [b for b in range(first.num_bins) if first.budget[b] > 0]
    # Half the predicted tokens, round after round: speculation stops paying.
    for _ in range(200):
        b = easy[0]
        policy.observe(first, [b], [0])
    assert policy.position_scale()[0] < 0.8
    assert not policy.plan(1).speculate
    # Root-only bins and plain plans teach nothing.
    before = policy.position_scale()
    policy.observe(policy.plan(1), [0], [5])
    assert policy.position_scale() == before
    # The workload turns easy again: speculation comes back.
    for _ in range(600):
        policy.observe(first, [easy[0]], [first.budget[easy[0]]])
    assert policy.position_scale()[0] > 1.0 and policy.plan(1).speculate
    assert margin_scale["speculative"]["tokens_per_s"] > margin_scale["plain"]["tokens_per_s"]


def test_action_survival_and_per_position_correction():
    """The tables' P(accepted >= j) of an action sums to its mean accepted length (for the
    synthetic chain tables: p, p^2, ...), and scaling positions changes only what they cover."""
    from heterospec.policy import action_survival, corrected_accept

    tables = _tables(easy_accept=0.8)
    opt = tables.options[0]
    for di in range(len(DEPTHS)):
        for ni in range(len(NODES)):
            sv = action_survival(tables, opt, 0, di, ni)
            assert sum(sv) == pytest.approx(opt.accept[0][di][ni])
            assert all(x >= y - 1e-12 for x, y in zip(sv, sv[1:]))       # non-increasing
    sv = action_survival(tables, opt, 0, DEPTHS.index(3), NODES.index(8))
    assert sv == pytest.approx([0.8 ** j for j in range(1, 5)])
    assert action_survival(tables, opt, 0, DEPTHS.index(3), NODES.index(1)) == []   # root only
    assert corrected_accept(sv, ()) == pytest.approx(sum(sv))
    assert corrected_accept(sv, (1.0, 0.5)) == pytest.approx(0.8 + 0.5 * (0.64 + 0.512 + 0.4096))
    # a scale above 1 never makes a later position likelier than an earlier one
    assert corrected_accept([0.5, 0.4], (1.0, 2.0)) == pytest.approx(1.0)


def test_fitted_policy_shortens_drafts_when_deep_positions_fail():
    """A workload whose first draft is accepted as the tables say but whose later drafts never
    are: the policy keeps speculating, with shorter drafts, instead of scaling every action
    alike (a single acceptance scale would also shrink the first position)."""
    tables, cost = _tables(easy_accept=0.9, hard_accept=0.05), LinearCost(a=10.0, b=0.3, c=0.2, e=0.2)
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    first = policy.plan(1)
    assert first.speculate and first.depth[0] >= 3 and first.budget[0] >= 4
    for r in range(100):   # position 1 accepted in 90 % of rounds, nothing deeper
        policy.observe(first, [0], [1 if r % 10 else 0])
    scale = policy.position_scale()
    assert scale[0] == pytest.approx(1.0) and all(x <= 0.1 for x in scale[1:])
    later = policy.plan(1)
    assert later.speculate and later.depth[0] < first.depth[0] and later.budget[0] < first.budget[0]
    assert later.predicted_accept[0] == pytest.approx(0.9, abs=0.1)
    # the learnt positions are part of the saved state
    other = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    other.load_state(policy.state())
    assert other.position_scale() == scale and other.plan(1).depth == later.depth


def test_held_out_check_is_where_a_fresh_workload_starts(tmp_path):
    """Tables that carry a held-out check (observed / predicted acceptance per position on prompts
    they were not fitted on) start a fresh policy's position scale there, as that much evidence:
    the policy's own rounds then move it as they would move any. The check survives a save and
    load of the tables; a malformed one is refused by name."""
    import dataclasses

    tables, cost = _tables(easy_accept=0.7), StepCost(verify_two=14.0, draft=(0.5, 0.5))
    cfg = SpecConfig(top_k=4, depth=1, total_tokens=4)
    plain_start = FittedPolicy(tables, cost, cfg)
    assert plain_start.position_scale() == (1.0,) * len(plain_start.position_scale())
    held = dataclasses.replace(tables, held_out={"position_scale": [0.6, 0.9], "predicted": [400.0, 120.0]})
    policy = FittedPolicy(held, cost, cfg)
    scale = policy.position_scale()
    assert scale[0] == pytest.approx(0.6)
    # deeper positions as the position scale reads evidence: from the one before, towards 0.9 of the tables
    assert 0.6 < scale[1] < 0.9 and all(x == scale[1] for x in scale[2:])
    # the prior lowers the drafts the speculative plans expect accepted (tokens of a round less the root's)
    def drafts(p):
        p = p if p.speculate else p.alternative
        return p.expected["speculative"]["tokens"] - 1.0
    assert drafts(policy.plan(1)) < 0.8 * drafts(plain_start.plan(1))
    # the workload's own rounds, accepted exactly as the tables predict, take it back to 1
    first = plain_start.plan(1)
    easy = [b for b in range(first.num_bins) if first.budget[b] > 0][0]
    for r in range(400):
        policy.observe(first, [easy], [_as_predicted(first, easy, r % 10, 10)])
    assert policy.position_scale()[0] == pytest.approx(1.0, abs=0.1)
    # saved and loaded with the tables
    path = tmp_path / "acceptance_tables.json"
    held.save(str(path))
    assert AcceptanceTables.load(str(path)).held_out == held.held_out
    assert "held_out" not in tables.to_dict()
    for bad in ([], [0.0], [1.2, -1], ["x"], [True], None):
        with pytest.raises(ValueError, match="held_out.position_scale"):
            dataclasses.replace(tables, held_out={"position_scale": bad})


def test_shipped_tables_carry_a_held_out_check_a_fresh_policy_starts_from():
    from heterospec.defaults import default_draft_dir

    tables = AcceptanceTables.find(str(default_draft_dir()), 4)
    held = tables.held_out
    assert held is not None and held["prompts"] >= 32 and "ChatterBot" in held["prompt_source"]
    policy = FittedPolicy(tables, LinearCost(a=10.0, b=1.0, c=0.5, e=0.5), SpecConfig(top_k=4, depth=3, total_tokens=8))
    assert policy.position_scale()[0] == pytest.approx(round(held["position_scale"][0] / 0.05) * 0.05)


def test_shipped_k10_tables_start_a_fresh_policy_at_their_deep_plans_check():
    """The GPU default tree's tables (10, 7, 60) carry a held-out check of deep plans (a GPU drafts
    5-7 positions; bench/results/cpu-emr-s78/k10_deep_held_out.py): a fresh policy there starts
    every measured position near it, not from the tables as fitted."""
    from heterospec.defaults import default_draft_dir

    tables = AcceptanceTables.find(str(default_draft_dir()), 10)
    assert tables is not None and tables.top_k == 10
    held = tables.held_out
    assert held is not None and held["prompts"] >= 32 and len(held["position_scale"]) >= 5, held
    scale = held["position_scale"]
    assert all(0.05 < s <= 2.0 for s in scale)
    policy = FittedPolicy(tables, LinearCost(a=10.0, b=1.0, c=0.5, e=0.5), SpecConfig(top_k=10, depth=7, total_tokens=60))
    used = policy.position_scale()
    assert used[0] == pytest.approx(round(scale[0] / 0.05) * 0.05)
    # deeper positions: the check, shrunk a little towards the position before (POSITION_PRIOR)
    for j, s in enumerate(scale):
        assert abs(used[j] - s) <= 0.1 and (s >= 0.95 or used[j] < 1.0), (j, used, scale)


def _chain_plan(survival):
    """A one-bin speculative plan whose tables predict ``survival`` (P(accepted >= j))."""
    d = len(survival) - 1
    return Plan("fitted", decide_depth=0, entropy_k=4, edges=[], depth=[d], budget=[max(d + 1, 1)],
                expected={"batch_size": 1}, predicted_accept=[sum(survival)], survival=[list(survival)])


def test_deep_position_scale_is_shrunk_towards_the_one_before_and_fades_back():
    """A deep position with little evidence moves from the scale of the position before it by a
    little, not to the floor (the old rule took 1.8 accepted of 11.4 predicted to 0.15, and a
    shallow plan then never measured it again); evidence it no longer gets fades into that prior."""
    tables, cost = _tables(easy_accept=0.9), LinearCost(a=10.0, b=0.3, c=0.2, e=0.2)
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    deep = _chain_plan([0.95, 0.9, 0.85, 0.8, 0.75])
    # 14 deep rounds: positions 1-3 accepted as the tables say, positions 4-5 twice.
    for r in range(14):
        policy.observe(deep, [0], [5 if r < 2 else 3 if r % 7 else 2])
    scale = policy.position_scale()
    assert scale[0] == pytest.approx(1.0) and scale[1] == pytest.approx(1.0)
    assert 0.4 <= scale[3] < 0.85 and scale[4] <= scale[3]          # lowered, well above the floor
    # Depth-1 rounds from now on, accepted as predicted: positions 4-5 are no longer measured and
    # their old evidence fades; their scale returns to the one before them.
    shallow = _chain_plan([0.95, 0.9])
    for r in range(600):
        policy.observe(shallow, [0], [2 if r % 20 else 1])
    later = policy.position_scale()
    assert later[3] > scale[3] + 0.1 and later[3] >= later[1] - 0.15
    # Many deep rounds that accept nothing past position 3 still take it down.
    for _ in range(200):
        policy.observe(deep, [0], [3])
    assert policy.position_scale()[3] <= 0.1


def test_fitted_policy_learns_the_workloads_bin_frequencies():
    """A workload whose requests all land in the hard bin: the expected tokens per round use this
    workload's bin frequencies, not the calibration ones, and speculation stops where it no longer
    pays (each bin's own acceptance is still as the tables say)."""
    # verifying two or more tokens costs 1.3x a one-token step
    tables = _tables(easy_accept=0.8, hard_accept=0.05, counts=(60, 40))
    cost = StepCost(verify_two=13.0, draft=(2.0, 0.3))
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    first = policy.plan(1)
    assert first.speculate and policy.bin_frequencies() == {}
    assert first.expected["option"] == 0 and first.expected["bin_freq"] is None
    for r in range(300):
        policy.observe(first, [1], [_as_predicted(first, 1, r % 30, 30)])
    freq = policy.bin_frequencies()[0]
    assert freq[1] > 0.85 and sum(freq) == pytest.approx(1.0)
    assert all(x == pytest.approx(1.0) for x in policy.position_scale())   # acceptance as predicted
    later = policy.plan(1)
    assert not later.speculate
    assert later.alternative.expected["bin_freq"] == pytest.approx(list(freq))
    other = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    other.load_state(policy.state())
    assert other.bin_frequencies() == policy.bin_frequencies() and not other.plan(1).speculate
    # The easy bin comes back: so does speculation.
    for _ in range(600):
        policy.observe(first, [0], [first.depth[0] + 1])
    assert policy.plan(1).speculate


def test_fitted_policy_learns_the_devices_round_time():
    """Rounds slower than the cost model said (a busy or mis-measured device) shrink speculation,
    down to plain decoding, per batch bucket."""
    tables = _tables(easy_accept=0.7)
    cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    plan = policy.plan(1)
    assert plan.speculate and policy.time_scale(1) == 1.0
    ratio = plan.expected["speculative"]["tokens_per_s"] / plan.expected["plain"]["tokens_per_s"]
    for r in range(30):   # every round takes twice the predicted time (accepting as predicted)
        policy.observe(plan, [0], [_as_predicted(plan, 0, r, 30)],
                       seconds=2e-3 * plan.expected["speculative"]["ms"])
    assert policy.time_scale(1) == pytest.approx(2.0)
    later = policy.plan(1)
    assert later.expected["time_scale"] == pytest.approx(2.0)
    assert later.speculate == (ratio / 2.0 >= 1.03)
    # A batch size not measured yet starts from the nearest measured one; then keeps its own.
    assert policy.time_scale(2) == pytest.approx(2.0)
    plan2 = policy.plan(2)
    plan2 = plan2 if plan2.speculate else plan2.alternative
    for r in range(30):
        policy.observe(plan2, [0, 0], [1, 1], seconds=1e-3 * plan2.expected["speculative"]["ms"] / 2.0)
    assert policy.time_scale(2) == pytest.approx(1.0) and policy.time_scale(1) == pytest.approx(2.0)


@pytest.mark.parametrize("B", [1, 4])
def test_static_rounds_price_the_deepest_bin_and_lift_every_bin_to_it(B):
    """Capture-ready rounds (CUDA graphs) have one shape per plan: every round drafts the deepest
    bin's forwards and verifies the largest budget. Priced so, a shallow bin costs as much as the
    deepest, and the fit gives every bin the same action (more accepted at no cost); priced per
    bin (eager rounds) the easy bin drafts deeper than the hard one."""
    tables, cost = _tables(), LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    eager = fit_plan(tables, cost, B)
    assert eager.speculate and len(set(zip(eager.depth, eager.budget))) > 1
    static = fit_plan(tables, cost, B, static=True)
    assert static.speculate and len(set(zip(static.depth, static.budget))) == 1
    ev = static.expected["speculative"]
    mean_new = ev["tokens"] / B
    want = cost.draft_ms(B, max(static.depth)) + (mean_new - 1.0) * (
        cost.draft_ms(B, max(static.depth), 2.0) - cost.draft_ms(B, max(static.depth))) + \
        cost.verify_ms(B, max(static.budget) + 1)
    assert ev["ms"] == pytest.approx(want)
    # the eager plan, run as static rounds, costs its deepest bin in every round: the static fit is better
    probs = [c / sum(tables.options[0].counts) for c in tables.options[0].counts]
    as_static = plan_cost(cost, B, eager.decide_depth, probs, eager.depth, [n + 1 for n in eager.budget],
                          eager.predicted_accept, 256, False, static=True)
    assert ev["tokens_per_s"] >= as_static["tokens_per_s"] * (1 - 1e-9)


def test_fitted_policy_learns_plain_step_time_and_probes_the_alternative():
    """Plain steps are timed too: when they turn out slower than the cost model said, speculation
    that was narrowly rejected is switched on. And a policy that decodes plainly still runs a
    speculative round every PROBE_EVERY rounds (and vice versa), so both corrections stay measured."""
    tables = _tables(easy_accept=0.7)
    cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    plan = policy.plan(1)
    ratio = plan.expected["speculative"]["tokens_per_s"] / plan.expected["plain"]["tokens_per_s"]
    # Make plain decoding look better first: spec rounds twice as slow as predicted.
    for r in range(30):
        policy.observe(plan, [0], [_as_predicted(plan, 0, r, 30)], seconds=2e-3 * plan.expected["speculative"]["ms"])
    plain = policy.plan(1)
    assert not plain.speculate and plain.alternative is not None and plain.alternative.speculate
    every = policy._probe_spacing(1, plain)        # PROBE_EVERY, or more where a burst is priced a clear loss
    kinds = [policy.round_plan(1).speculate for _ in range(2 * (every + FittedPolicy.PROBE_BURST))]
    burst = FittedPolicy.PROBE_BURST                # the probes: bursts of speculative rounds
    assert kinds.count(True) == 2 * burst and all(kinds[every - 1:][:burst])
    # Plain steps take three times what the cost model said: speculation pays again.
    for _ in range(30):
        policy.observe(plain, [], [], seconds=3e-3 * plain.expected["plain"]["ms"])
    assert policy.plain_scale(1) == pytest.approx(3.0)
    again = policy.plan(1)
    assert again.expected["plain_scale"] == pytest.approx(3.0)
    assert again.speculate == (ratio * 3.0 / 2.0 >= 1.03)
    assert policy.plain_scale(2) == pytest.approx(3.0)      # unmeasured: the nearest measured
    state = policy.state()
    other = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    other.load_state(state)
    assert other.plain_scale(1) == pytest.approx(3.0) and other.state() == state


def test_speculating_bucket_that_clearly_wins_probes_plain_steps_less_often():
    """Plain probes of a speculating bucket come PROBE_EVERY rounds apart while speculation's
    measured lead is small, PROBE_EVERY << CLEAR_WIN_BACKOFF apart once it is CLEAR_WIN or more.
    A probe is two plain steps (the engine does not time the first, a switch)."""
    tables = _tables(easy_accept=0.7)
    cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    for spec_s, every in ((0.017, FittedPolicy.PROBE_EVERY),          # 2 tokens / 17 ms: 1.18x plain
                          (0.010, FittedPolicy.PROBE_EVERY << FittedPolicy.CLEAR_WIN_BACKOFF)):   # 2x
        policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
        policy.GUARD_PRIOR_ROUNDS = 0.0         # judge by the measured rounds alone
        spec = policy.plan(1)
        for _ in range(6):
            policy.observe(spec, [0], [1], seconds=spec_s)
            policy.observe(spec.alternative, [], [], seconds=0.010)
        kinds = [policy.round_plan(1).speculate for _ in range(4 * FittedPolicy.PROBE_EVERY + 1)]
        starts = [n + 1 for n, k in enumerate(kinds) if not k and n > 0 and kinds[n - 1]]
        assert all(not kinds[n] for n in starts)                        # each probe's second step
        late = [n for n in starts if n > max(FittedPolicy.EARLY_PLAIN_PROBES)]
        assert late == list(range(every, 4 * FittedPolicy.PROBE_EVERY + 1, every)), (spec_s, late)


def test_realized_throughput_guard_falls_back_to_plain_steps():
    """Whatever the model predicts, a bucket whose speculative rounds deliver fewer tokens per
    second than its plain steps decodes plainly (probing speculation), and speculates again once
    speculation delivers more. A speculating bucket probes plain steps early (rounds 3, 6, ...),
    two at a time (rounds 3-4, 6-7, ...: the engine does not time the first, a switch)."""
    tables = _tables(easy_accept=0.7)
    cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    spec = policy.plan(1)
    assert spec.speculate and spec.alternative is not None and not spec.alternative.speculate
    kinds = [policy.round_plan(1).speculate for _ in range(FittedPolicy.PROBE_EVERY)]
    plain_rounds = [n + 1 for n, k in enumerate(kinds) if not k]
    probes = FittedPolicy.EARLY_PLAIN_PROBES + (FittedPolicy.PROBE_EVERY,)
    assert plain_rounds == sorted(r for p in probes for r in (p, p + 1) if r <= FittedPolicy.PROBE_EVERY)
    # Speculative rounds take 40 ms for 2 tokens per request (50 tok/s), plain steps 10 ms (100 tok/s).
    for _ in range(4):
        policy.observe(spec, [0], [1], seconds=0.040)
    for _ in range(3):
        policy.observe(spec.alternative, [], [], seconds=0.010)
    assert policy.realized(1) is None and policy.plan(1).speculate        # not enough rounds yet
    policy.observe(spec, [0], [1], seconds=0.040)
    # measured 50 tok/s, plus the model's own prediction as GUARD_PRIOR_ROUNDS rounds
    f = FittedPolicy.REALIZED_FORGET
    measured_n = sum(f ** i for i in range(5))
    prior_tok, prior_s, n = policy._speculative_prior(1)
    assert n == FittedPolicy.GUARD_PRIOR_ROUNDS                         # batch 1: the whole prior
    assert prior_tok / prior_s > 100.0                                   # the model says speculate
    want = (2.0 * measured_n + n * prior_tok) / (0.040 * measured_n + n * prior_s)
    assert policy.realized(1) == pytest.approx((want, 100.0))
    assert want < 100.0
    guarded = policy.plan(1)
    fitted = policy.fitted_plan(1)
    assert not guarded.speculate and fitted.speculate and guarded.alternative is fitted
    assert policy.needs_draft(1)                                         # the draft stays loaded
    assert policy.held_plain(1)            # measured losing, its last speculative rounds too
    # A larger bucket not measured yet inherits the loss; one measured itself has its own verdict.
    assert not policy.plan(2).speculate and policy.fitted_plan(2).speculate
    assert not policy.held_plain(2)        # an inherited verdict: no rounds of its own lost
    for _ in range(5):
        policy.observe(policy.fitted_plan(2), [0, 0], [3, 3], seconds=0.015)
        policy.observe(policy.fitted_plan(2).alternative, [], [], seconds=0.010)
    assert policy.plan(2).speculate and policy.plan(3).speculate        # 3 inherits from 2: it won
    # Speculation turns fast (probe rounds): the bucket speculates again.
    for _ in range(60):
        policy.observe(spec, [0], [3], seconds=0.015)
    assert policy.plan(1).speculate and not policy.held_plain(1)


def test_a_new_request_is_judged_on_its_own_rounds_at_batch_1_only():
    """The guard's verdict came from earlier prompts: a new call at batch 1 keeps CALL_CARRY
    rounds of it, so the new prompt speculates again until its own rounds are measured; at
    batch 4 (a round averages four prompts) the verdict stands."""
    def held_plain(B):
        cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5) if B == 1 else LinearCost(a=10.0, b=0.3, c=0.2, e=0.2)
        policy = FittedPolicy(_tables(easy_accept=0.7), cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
        spec = policy.fitted_plan(B)
        assert spec.speculate
        for _ in range(5):    # 2 tokens per request in 40 ms, plain steps 1 in 10 ms: the guard holds plain
            policy.observe(spec, [0] * B, [1] * B, seconds=0.040)
        for _ in range(3):
            policy.observe(spec.alternative, [], [], seconds=0.010)
        assert policy.realized_loses(B) and not policy.plan(B).speculate and policy.fitted_plan(B).speculate
        return policy, spec

    policy, _ = held_plain(4)
    policy.new_requests(4)
    assert not policy.plan(4).speculate                 # 5 rounds of 4 prompts: within 2 rounds per request
    policy, spec = held_plain(1)
    policy.new_requests(1)
    assert policy.realized(1) is None and policy.plan(1).speculate
    for _ in range(3):        # the new prompt's own rounds lose too: plain again
        policy.observe(spec, [0], [1], seconds=0.040)
    assert policy.realized_loses(1) and not policy.plan(1).speculate
    policy.new_requests(1)
    for _ in range(3):        # this one's rounds win: the guard lets it speculate
        policy.observe(spec, [0], [3], seconds=0.012)
    assert not policy.realized_loses(1)


def test_guard_turns_plain_only_on_a_loss_clear_of_its_rounds_spread():
    """The guard compares speculation's measured rate with plain steps' within GUARD_Z standard
    errors of the rounds' tokens per request: rounds of 1 and 3 tokens (mean 2) a little slower
    than plain steps for the same tokens keep speculating; rounds of exactly 2 tokens at the same
    rate turn the bucket plain, as do the noisy rounds once they lose clearly."""
    def policy_after(tokens, seconds, rounds=40):
        policy = FittedPolicy(_tables(easy_accept=0.7), LinearCost(a=10.0, b=1.0, c=0.5, e=0.5),
                              SpecConfig(top_k=4, depth=1, total_tokens=4))
        spec = policy.plan(1)
        assert spec.speculate
        for i in range(rounds):
            policy.observe(spec, [0], [tokens[i % len(tokens)] - 1], seconds=seconds)
            policy.observe(spec.alternative, [], [], seconds=0.010)
        return policy

    noisy = policy_after((1, 3), 0.0215)
    spec_rate, plain_rate = noisy.realized(1)
    assert spec_rate < plain_rate and not noisy.realized_loses(1)        # within the noise
    steady = policy_after((2,), 0.0215)
    assert steady.realized(1) == pytest.approx(noisy.realized(1), rel=0.02) and steady.realized_loses(1)
    assert policy_after((1, 3), 0.030).realized_loses(1)                 # a clear loss
    # the spread survives a save and a load; a state saved without it loads with none
    state = noisy.state()
    again = FittedPolicy(_tables(easy_accept=0.7), LinearCost(a=10.0, b=1.0, c=0.5, e=0.5),
                         SpecConfig(top_k=4, depth=1, total_tokens=4))
    again.load_state(state)
    assert not again.realized_loses(1)
    state["realized"] = {b: v[:6] for b, v in state["realized"].items()}
    again.load_state(state)
    r = again.realized(1)
    assert r[0] < r[1] and again.realized_loses(1)


class _ContextCost(LinearCost):
    """LinearCost whose steps grow with the context: 1x at 256 tokens, 2x at 1,024."""

    @staticmethod
    def _grow(context):
        return 1.0 + (max(int(context), 256) - 256) / 768.0

    def verify_ms(self, B, nodes, context=256):
        return super().verify_ms(B, nodes) * self._grow(context)

    def plain_ms(self, B, context=256):
        return super().plain_ms(B) * self._grow(context)


def test_guard_compares_speculation_and_plain_steps_at_one_context():
    """Plain steps measured on a long request (context 1,024: 22 ms, the model's price there)
    and speculative rounds on a short one (context 256: 2 tokens in 27 ms, where a plain step
    costs 11 ms): per token speculation loses (74 tok/s against 91), though its raw rate beats
    the long request's plain steps (45 tok/s). The guard scales every time to GUARD_CONTEXT by
    the cost model's plain steps and holds the bucket plain; unscaled (no context given) it would
    have let it speculate."""
    def run(with_context):
        policy = FittedPolicy(_tables(easy_accept=0.7), _ContextCost(a=10.0, b=1.0, c=0.5, e=0.5),
                              SpecConfig(top_k=4, depth=1, total_tokens=4))
        spec = policy.plan(1)
        assert spec.speculate
        for _ in range(40):
            policy.observe(spec.alternative, [], [], seconds=0.022, context=1024 if with_context else None)
        for _ in range(40):
            policy.observe(spec, [0], [1], seconds=0.027, context=256 if with_context else None)
        return policy

    scaled = run(True)
    spec_rate, plain_rate = scaled.realized(1)
    assert plain_rate == pytest.approx(1.0 / 0.011, rel=1e-6)      # 22 ms at 1,024 = 11 ms at 256
    assert spec_rate < plain_rate and scaled.realized_loses(1) and not scaled.plan(1).speculate
    unscaled = run(False)
    assert unscaled.realized(1)[1] == pytest.approx(1.0 / 0.022, rel=1e-6)
    assert not unscaled.realized_loses(1) and unscaled.plan(1).speculate


def test_guard_is_not_turned_by_a_few_unlucky_rounds_but_by_a_real_loss():
    """Five speculative rounds that accepted nothing (8 % likely at an acceptance of 0.4) and
    ran 10 % slower than a plain step: the model's prediction (a clear win) outweighs them; the
    same loss kept up turns the bucket plain within a few more rounds."""
    tables = _tables(easy_accept=0.7)
    cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    spec = policy.plan(1)
    assert spec.speculate
    for _ in range(5):
        policy.observe(spec, [0], [0], seconds=0.011)                    # 1 token in 11 ms
    for _ in range(3):
        policy.observe(spec.alternative, [], [], seconds=0.010)          # 1 token in 10 ms
    assert policy.realized(1) is not None and policy.plan(1).speculate
    rounds = 0
    while policy.plan(1).speculate:
        policy.observe(spec, [0], [0], seconds=0.011)
        rounds += 1
        assert rounds < 40, "a sustained loss never turned the bucket plain"
    assert rounds >= 2


def test_guard_judges_a_static_batch_by_the_requests_furthest_behind():
    """Rounds that gave the batch 2.5 tokens per request (125 tok/s against 100 for plain steps)
    but its slowest request 1 (50 tok/s): credited with the batch mean the bucket speculates,
    credited with what the caller says the furthest-behind requests got it decodes plainly."""
    tables = _tables(easy_accept=0.7)
    cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    verdicts = []
    for progress in (None, 1.0):
        policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
        spec = policy.plan(2)
        assert spec.speculate
        for _ in range(5):
            policy.observe(spec, [0, 1], [3, 0], seconds=0.020, progress=progress)
            policy.observe(spec.alternative, [], [], seconds=0.010, progress=None if progress is None else 1.0)
        speculates = policy.plan(2).speculate       # (may refit: the prior below is the new plan's)
        verdicts.append((policy.realized(2), speculates))
        prior_tok, prior_s, n = policy._speculative_prior(2)
        assert n == FittedPolicy.GUARD_PRIOR_ROUNDS / 2          # a round's mean over 2 requests
        measured = sum(FittedPolicy.REALIZED_FORGET ** i for i in range(5))
        tok = 2.5 if progress is None else 1.0
        want = (tok * measured + n * prior_tok) / (0.020 * measured + n * prior_s)
        assert verdicts[-1][0] == pytest.approx((want, 100.0))
    assert verdicts[0][0][0] > 100.0 and verdicts[0][1]
    assert verdicts[1][0][0] < 100.0 and not verdicts[1][1]


def test_fitted_policy_refits_a_bucket_at_most_every_refit_gap_rounds():
    """A fit costs several plain steps: while the corrections settle, a bucket keeps its plan
    for REFIT_GAP observed rounds, then takes up what was learned."""
    tables, cost = _tables(easy_accept=0.9, hard_accept=0.05), LinearCost(a=10.0, b=0.3, c=0.2, e=0.2)
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    first = policy.plan(1)
    for r in range(FittedPolicy.REFIT_GAP - 1):
        policy.observe(first, [0], [0])         # nothing accepted: the corrections move at once
    assert policy.position_scale()[0] < 0.5
    assert policy.plan(1) is first              # not yet refitted
    policy.observe(first, [0], [0])
    later = policy.plan(1)
    assert later is not first and later.expected["position_scale"][0] < 0.5
    policy.refit()                              # an explicit refit is immediate
    assert policy.plan(1) is not later


def _tables_of_options(accepts=(0.5, 0.6, 0.7, 0.8, 0.9)):
    """One binning option per ``easy_accept`` (the last fits best)."""
    opts = [_tables(easy_accept=a).options[0] for a in accepts]
    return AcceptanceTables(4, DEPTHS, NODES, opts)


def test_a_speculative_plan_that_verifies_the_root_only_everywhere_is_no_alternative():
    """Where every bin's best action verifies the root only (verify nodes dear, drafts rarely
    accepted), the speculative plan is a plain step plus the draft's forwards: fit_plan returns
    the plain plan with nothing to probe, and the fitted policy keeps the bucket plain for good
    (no probe bursts, ``plain_rounds_ahead`` never)."""
    tables, cost = _tables(easy_accept=0.3), LinearCost(a=10.0, b=10.0, c=1.0, e=1.0)
    from heterospec.policy import _MemoCost, _fit_option
    acts, _ = _fit_option(tables, tables.options[0], _MemoCost(cost), 1, 256, False, None, (), None)
    assert all(a[1] == 1 for a in acts)            # the best speculative actions: root only
    plan = fit_plan(tables, cost, 1)
    assert not plan.speculate and plan.alternative is None
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    assert not any(policy.round_plan(1).speculate for _ in range(3 * policy.PROBE_EVERY))
    assert policy.plain_rounds_ahead(1) == policy.NEVER_PROBED
    # one bin with an action worth verifying: a speculative alternative again
    tables = _tables(easy_accept=0.97)
    plan = fit_plan(tables, cost, 1)
    assert (plan.alternative if not plan.speculate else plan).budget[0] > 0


def test_fit_plan_fits_only_the_options_asked_and_reports_their_scores():
    tables, cost = _tables_of_options(), LinearCost(a=10.0, b=0.3, c=0.2, e=0.2)
    scores = {}
    best = fit_plan(tables, cost, 1, scores=scores)
    assert best.expected["option"] == 4 and sorted(scores) == [0, 1, 2, 3, 4]
    assert max(scores, key=scores.get) == 4
    scores = {}
    one = fit_plan(tables, cost, 1, options=[1], scores=scores)
    assert one.expected["option"] == 1 and list(scores) == [1]
    assert fit_plan(tables, cost, 2, options=[2, 3]).expected["option"] == 3


@pytest.mark.parametrize("B", [1, 4])
def test_refits_between_full_fits_search_the_shortlist_only(monkeypatch, B):
    """A fit searches every binning option; between full fits (every FULL_EVERY-th fit of a
    bucket) a refit searches the SHORTLIST options that fitted best in the last full one."""
    import heterospec.policy as P
    tables, cost = _tables_of_options(), LinearCost(a=10.0, b=0.3, c=0.2, e=0.2)
    fitted = []
    inner = P._fit_option

    def counting(tables_, opt, *a, **k):
        fitted.append(tables_.options.index(opt))
        return inner(tables_, opt, *a, **k)
    monkeypatch.setattr(P, "_fit_option", counting)
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    per_fit = []
    for _ in range(FittedPolicy.FULL_EVERY + 1):
        fitted.clear()
        plan = policy.plan(B)
        per_fit.append(set(fitted))
        assert plan.expected["option"] == 4          # the best option stays in the shortlist
        policy._plans.clear()                         # as if the corrections had moved
        policy._last_fit.clear()
        policy._shortlist.clear()
        policy._option_fits.clear()                   # (acceptance ones: the option fits are keyed by them)
        policy._version += 1                          # (and plan() is memoised per state version)
    assert per_fit[0] == {0, 1, 2, 3, 4} and per_fit[FittedPolicy.FULL_EVERY] == {0, 1, 2, 3, 4}
    assert all(s == {2, 3, 4} for s in per_fit[1:FittedPolicy.FULL_EVERY])
    policy.refit()                                    # a new cost model: a full fit at once
    fitted.clear()
    policy.plan(B)
    assert set(fitted) == {0, 1, 2, 3, 4}



def test_a_refit_that_only_the_time_scales_moved_reuses_the_option_fits(monkeypatch):
    """The time scales only scale an option's evaluation: a refit after plain steps moved the
    plain scale (a plain bucket's usual refit) re-decides from the kept option fits, without a
    search, and picks what a fresh fit with that scale picks; a moved acceptance correction
    searches again."""
    import heterospec.policy as P
    tables = _tables(easy_accept=0.7)
    cost = LinearCost(a=10.0, b=1.0, c=1.5, e=1.5)
    calls = []
    inner = P._fit_option

    def counting(*a, **k):
        calls.append(bool(a[9]) if len(a) > 9 else bool(k.get("quick")))   # quick: the shortlist's starts
        return inner(*a, **k)

    monkeypatch.setattr(P, "_fit_option", counting)
    fits = {}
    for B in (1, 4):
        first = fit_plan(tables, cost, B, fits=fits)
        decided = set()
        for q in (0.5, 1.3, 3.0):
            calls.clear()
            kept = fit_plan(tables, cost, B, plain_scale=q, time_scale=1.1, fits=fits)
            assert not any(not quick for quick in calls)          # no full search of an option
            fresh = fit_plan(tables, cost, B, plain_scale=q, time_scale=1.1)
            assert kept.to_dict() == fresh.to_dict()
            decided.add(kept.speculate)
        assert decided == {True, False}                       # the scales did move the decision
        assert first.expected["speculative"] is not kept.expected["speculative"]   # each plan its own copy
        calls.clear()
        fit_plan(tables, cost, B, position_scale=(1.0, 0.8), fits=fits)
        assert any(not quick for quick in calls)               # an acceptance correction: a new search

def test_fitted_policy_refits_at_once_when_fits_are_cheap_against_the_rounds():
    """Timed rounds: a bucket takes up moved corrections after one round while fitting stays
    under FIT_SHARE of the rounds' time (a fresh workload's first corrections must not wait
    REFIT_GAP rounds of a plan they contradict), and waits when fits would exceed it."""
    tables, cost = _tables(easy_accept=0.9, hard_accept=0.05), LinearCost(a=10.0, b=0.3, c=0.2, e=0.2)
    for seconds, refits_at_once in ((10.0, True), (1e-7, False)):
        policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
        first = policy.plan(1)
        for _ in range(12):         # nothing accepted: the position correction moves (< REFIT_GAP rounds)
            policy.observe(first, [0], [0], seconds=seconds)
        assert policy.position_scale()[0] < 0.5
        assert (policy.plan(1) is not first) == refits_at_once
        assert policy._fit_s > 0


def test_draft_catch_up_after_plain_steps_is_not_held_against_speculation():
    """A round whose draft first extends over many tokens (a plain stretch, a new prompt) is
    timed without the cost model's price of that excess (at most half the round)."""
    tables = _tables(easy_accept=0.7)
    policy = FittedPolicy(tables, ExtendCost(a=10.0, b=1.0, c=0.5, e=0.5), SpecConfig(top_k=4, depth=1, total_tokens=4))
    spec = policy.plan(1)
    steady = spec.expected["speculative"]["tokens"]
    policy.observe(spec, [0], [1], seconds=0.030, extend_tokens=steady)        # steady: as measured
    assert policy._realized[1][1] == pytest.approx(0.030)
    policy.observe(spec, [0], [1], seconds=0.030, extend_tokens=steady + 20)   # 20 extra: 10 ms off
    assert policy._realized[1][1] == pytest.approx(0.030 * policy.REALIZED_FORGET + 0.020)
    policy.observe(spec, [0], [1], seconds=0.030, extend_tokens=steady + 200)  # never below half
    assert policy._realized[1][1] == pytest.approx((0.030 * policy.REALIZED_FORGET + 0.020) *
                                                  policy.REALIZED_FORGET + 0.015)


def test_a_round_s_measured_one_off_work_is_taken_off_its_time_in_full_and_counted_as_catch_up():
    """``one_off_s`` (the draft's deferred prompt pass, measured by the engine) comes off the
    round's seconds in full, beyond the half a priced catch-up may take, before the modelled
    catch-up of the rest; the guard's record of the round keeps both as catch-up (what a probe
    costs), and a round that was all one-off work is not timed."""
    tables = _tables(easy_accept=0.7)
    policy = FittedPolicy(tables, ExtendCost(a=10.0, b=1.0, c=0.5, e=0.5), SpecConfig(top_k=4, depth=1, total_tokens=4))
    spec = policy.plan(1)
    steady = spec.expected["speculative"]["tokens"]
    policy.observe(spec, [0], [1], seconds=0.080, extend_tokens=steady + 20, one_off_s=0.050)
    assert policy._realized[1][1] == pytest.approx(0.080 - 0.050 - 0.010)          # the pass, then 10 ms priced
    assert policy._recent_spec[1][-1][1:] == pytest.approx((0.020, 0.060))
    obs, _, n = policy._time[1]
    assert (obs, n) == (pytest.approx(20.0), 1.0)
    policy.observe(spec, [0], [1], seconds=0.030, extend_tokens=steady, one_off_s=0.040)   # all one-off
    assert policy._time[1][2] == 1.0 and len(policy._recent_spec[1]) == 1      # (untouched)


@pytest.mark.parametrize("draft_ms,spacing", [(4.0, "every"), (10.0, "priced"), (20.0, "cap")])
def test_plain_bucket_probes_as_often_as_their_predicted_loss_allows(draft_ms, spacing):
    """A plain bucket's probe bursts come PROBE_EVERY rounds apart while the model predicts
    speculation close to plain steps (4 ms drafts: 0.93x), and further apart where it predicts a
    clear loss: a burst then costs at most PROBE_LOSS_SHARE of the plain time in between (10 ms:
    0.59x), up to PROBE_EVERY << MAX_PRICED_BACKOFF rounds (20 ms: 0.36x)."""
    policy = FittedPolicy(_tables(easy_accept=0.7), LinearCost(a=10.0, b=1.0, c=draft_ms, e=draft_ms),
                          SpecConfig(top_k=4, depth=1, total_tokens=4))
    plan = policy.plan(1)
    assert not plan.speculate and plan.alternative is not None
    spec, plain = plan.expected["speculative"], plan.expected["plain"]
    loss_ms = spec["ms"] - spec["tokens"] / plain["tokens"] * plain["ms"]
    priced = math.ceil(policy.PROBE_BURST * loss_ms / (policy.PROBE_LOSS_SHARE * plain["ms"]))
    want = {"every": policy.PROBE_EVERY, "priced": priced,
            "cap": policy.PROBE_EVERY << policy.MAX_PRICED_BACKOFF}[spacing]
    assert spacing != "priced" or policy.PROBE_EVERY < priced < policy.PROBE_EVERY << policy.MAX_PRICED_BACKOFF
    kinds = [policy.round_plan(1).speculate for _ in range(want + policy.PROBE_BURST)]
    assert kinds.index(True) + 1 == want and all(kinds[want - 1:want - 1 + policy.PROBE_BURST])  # a whole burst


def test_guard_held_bucket_probes_as_often_as_its_measured_loss_allows():
    """Where the guard holds a bucket plain against a model that predicts a gain, the model
    cannot price the probes (it sees no loss): the last burst's measured loss does. Speculative
    rounds of 25 ms for 2 tokens per request against plain steps of 10 ms: 5 ms lost per round,
    so a burst of PROBE_BURST costs PROBE_LOSS_SHARE of 5 * 5 / (0.01 * 10) = 250 plain rounds,
    not PROBE_EVERY."""
    policy = FittedPolicy(_tables(easy_accept=0.7), LinearCost(a=10.0, b=1.0, c=0.5, e=0.5),
                          SpecConfig(top_k=4, depth=1, total_tokens=4))
    policy.EARLY_PLAIN_PROBES = ()
    spec = policy.plan(1)
    assert spec.speculate and policy._predicted_probe_loss(spec) == 0.0      # the model predicts a gain
    for _ in range(8):
        policy.observe(spec, [0], [1], seconds=0.025)                      # 2 tokens per request
        policy.observe(spec.alternative, [], [], seconds=0.010)
    assert policy.realized_loses(1) and not policy.plan(1).speculate       # the guard holds it plain
    want = round(policy.PROBE_BURST * (0.025 - 2 * 0.010) / (policy.PROBE_LOSS_SHARE * 0.010))   # 250
    assert policy.PROBE_EVERY < want < policy.PROBE_EVERY << policy.MAX_PRICED_BACKOFF
    kinds = []
    for _ in range(want + 2):
        p = policy.round_plan(1)
        kinds.append(p.speculate)
        if not p.speculate:
            policy.observe(p, [], [], seconds=0.010)
    assert abs(kinds.index(True) + 1 - want) <= 1         # (the ceiling of a float sum)
    # The same bucket without burst measurements is spaced by PROBE_EVERY (doubled per lost probe).
    policy._recent_spec.clear()
    assert policy._probe_spacing(1, policy.plan(1)) == policy.PROBE_EVERY << policy._backoff.get(1, 0)


def test_time_corrections_compare_a_round_with_its_own_batch_size_not_its_bucket_s():
    """A round of 15 requests runs a plan fitted for bucket 12: told the batch size, observe
    scales the predictions its time corrections compare with by the cost model's plain step at
    15 against 12, so rounds that took what the model says for 15 requests leave both
    corrections at 1 (without it they read as the model's error, 1.15x here)."""
    tables = _tables(easy_accept=0.7)
    cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)            # plain: 10 + B ms
    for told in (True, False):
        policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
        plain = policy.plan(15)
        if plain.speculate:
            plain = plain.alternative
        assert plain.expected["batch_size"] == 12
        spec = plain.alternative
        kw = {"batch_size": 15} if told else {}
        for r in range(40):
            policy.observe(plain, [], [], seconds=1e-3 * 25.0, **kw)       # the model's plain step at 15
            policy.observe(spec, [0], [_as_predicted(spec, 0, r, 40)],
                           seconds=1e-3 * spec.expected["speculative"]["ms"] * 25.0 / 22.0, **kw)
        want = 1.0 if told else 1.15
        assert policy.plain_scale(12) == pytest.approx(want) and policy.time_scale(12) == pytest.approx(want)


def test_a_stall_counts_as_stall_factor_times_its_prediction():
    """One round or plain step timed far above its prediction (a stall, a process's one-off)
    counts as STALL_FACTOR times the prediction in the time corrections and in the guard: among
    eight as predicted, a 20x round leaves a correction near 1, not at the cap (the corrections
    forget a round over hundreds)."""
    from heterospec.timing import STALL_FACTOR
    tables = _tables(easy_accept=0.7)
    cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    plain = policy.plan(1)
    plain = plain if not plain.speculate else plain.alternative
    spec = plain.alternative
    p_ms, s_ms = plain.expected["plain"]["ms"], spec.expected["speculative"]["ms"]
    for r in range(9):
        x = 20.0 if r == 4 else 1.0
        policy.observe(plain, [], [], seconds=1e-3 * p_ms * x)
        policy.observe(spec, [0], [_as_predicted(spec, 0, r, 9)], seconds=1e-3 * s_ms * x)
    def weighted(f):
        return sum(f ** (8 - r) * (STALL_FACTOR if r == 4 else 1.0) for r in range(9)) / sum(f ** k for k in range(9))
    want = weighted(policy.FORGET)
    # (the plain steps' evidence also ages by PLAIN_AGE per speculative round between them)
    assert policy._plain[1][0] / policy._plain[1][1] == pytest.approx(weighted(policy.FORGET * policy.PLAIN_AGE))
    assert policy._time[1][0] / policy._time[1][1] == pytest.approx(want)
    assert want < 1.25 and policy.plain_scale(1) <= 1.25 and policy.time_scale(1) <= 1.25
    g = policy.REALIZED_FORGET
    spec_s = sum(g ** (8 - r) * 1e-3 * s_ms * (STALL_FACTOR if r == 4 else 1.0) for r in range(9))
    assert policy._realized[1][1] == pytest.approx(spec_s)


def test_without_timed_speculative_rounds_a_bucket_s_rounds_take_its_plain_correction():
    """Until speculative rounds were timed anywhere, a bucket's round-time correction is its
    plain-step correction (measured, or inherited from the nearest measured bucket): plain steps
    measured 1.3x slower than the model do not make speculation look 1.3x cheaper. Once rounds
    are timed, their own correction takes over."""
    tables = _tables(easy_accept=0.7)
    cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    plain = policy.plan(8)
    plain = plain if not plain.speculate else plain.alternative
    for _ in range(20):
        policy.observe(plain, [], [], seconds=1.3e-3 * plain.expected["plain"]["ms"])
    assert policy.plain_scale(8) == pytest.approx(1.3)
    assert policy.time_scale(8) == pytest.approx(1.3) and policy.time_scale(4) == pytest.approx(1.3)
    ratio = lambda p: p.expected["speculative"]["tokens_per_s"] / p.expected["plain"]["tokens_per_s"]
    before = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4)).plan(8)
    assert ratio(policy.plan(8)) == pytest.approx(ratio(before), rel=0.02)     # the model's verdict stands
    spec = policy.plan(8)
    spec = spec if spec.speculate else spec.alternative
    for r in range(20):
        policy.observe(spec, [0], [_as_predicted(spec, 0, r, 20)],
                       seconds=1e-3 * spec.expected["speculative"]["ms"] / spec.expected["time_scale"])
    assert policy.time_scale(8) == pytest.approx(1.0) and policy.plain_scale(8) == pytest.approx(1.3)


def test_a_probe_burst_waits_for_a_timed_round():
    """A plain bucket's probe burst, when due, waits while the engine's rounds are untimed (the
    tail of a static batch: finished rows ride along and observe gets no seconds) and starts at
    the first timed round; untimed rounds never speculate there."""
    tables = _tables(easy_accept=0.7)
    cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    plan = policy.plan(1)
    for r in range(30):           # speculation measured twice as slow as predicted: held plain
        policy.observe(plan, [0], [_as_predicted(plan, 0, r, 30)], seconds=2e-3 * plan.expected["speculative"]["ms"])
    plain = policy.plan(1)
    assert not plain.speculate and plain.alternative is not None
    every = policy._probe_spacing(1, plain)
    untimed = [policy.round_plan(1, timed=False).speculate for _ in range(3 * every)]
    assert not any(untimed)
    timed = [policy.round_plan(1).speculate for _ in range(FittedPolicy.PROBE_BURST + 1)]
    assert timed == [True] * FittedPolicy.PROBE_BURST + [False]


def test_a_plain_stretch_plans_in_full_every_few_rounds_and_probes_on_the_same_schedule():
    """Between two full plans of a plain bucket (at most PLAIN_REPLAN plain steps apart) a
    round keeps the stretch's plan and probe spacing: the probe bursts come on the rounds a full
    plan every round gives them, while plan() runs on a fraction of the rounds; any evidence
    but a plain step's time (a speculative round, a new call) ends the stretch at once."""
    def guard_held():
        policy = FittedPolicy(_tables(easy_accept=0.7), LinearCost(a=10.0, b=1.0, c=0.5, e=0.5),
                              SpecConfig(top_k=4, depth=1, total_tokens=4))
        policy.EARLY_PLAIN_PROBES = ()
        spec = policy.plan(1)
        for _ in range(8):
            # 2 tokens per request: a burst prices the spacing at 247.5 plain rounds (a ceiling
            # clear of float noise in the forgotten sums)
            policy.observe(spec, [0], [1], seconds=0.02495)
            policy.observe(spec.alternative, [], [], seconds=0.010)
        assert policy.realized_loses(1) and not policy.plan(1).speculate
        return policy

    def run(policy, rounds):
        got = []
        for _ in range(rounds):
            p = policy.round_plan(1, tokens_left=100)
            got.append((p.speculate, policy.plain_rounds_ahead(1)))
            policy.observe(p, [0] if p.speculate else [], [1] if p.speculate else [],
                           seconds=0.02495 if p.speculate else 0.010)
        return got

    full = guard_held()
    full.PLAIN_REPLAN = 0                    # every round planned in full (as before stretches)
    stretched = guard_held()
    plans = []
    plan = stretched.plan
    stretched.plan = lambda *a, **k: plans.append(1) or plan(*a, **k)
    want = run(full, 700)
    assert run(stretched, 700) == want
    assert sum(k for k, _ in want) >= 2 * stretched.PROBE_BURST       # (two probe bursts in there)
    assert len(plans) < 700 / (stretched.PLAIN_REPLAN + 1) + 4 * stretched.PROBE_BURST
    # A new call (at batch 1 the guard's verdict is re-judged on the new prompt's rounds) ends
    # a stretch: its first round speculates ...
    policy = guard_held()
    assert policy.fitted_plan(1).speculate
    assert not any(k for k, _ in run(policy, 3))
    policy.new_requests(1)
    assert policy.round_plan(1, tokens_left=100).speculate
    # ... as a speculative round's evidence does (one observed outside the schedule): the next
    # round plans in full.
    policy = guard_held()
    plans, plan = [], policy.plan
    policy.plan = lambda *a, **k: plans.append(1) or plan(*a, **k)
    run(policy, 3)
    assert len(plans) == 1
    policy.observe(policy.fitted_plan(1), [0], [3], seconds=0.005)
    policy.round_plan(1, tokens_left=100)
    assert len(plans) == 2


def test_a_fresh_larger_bucket_prices_its_probes_by_a_smaller_bucket_s_lost_burst():
    """Speculation gains less as the batch grows: a bucket with no burst of its own takes the
    measured loss of the largest smaller bucket that has one, so its first probe waits as long
    as that loss allows instead of PROBE_EVERY rounds; once it has measured its own burst, its
    own loss prices it."""
    policy = FittedPolicy(_tables(easy_accept=0.7), LinearCost(a=10.0, b=1.0, c=0.5, e=0.5),
                          SpecConfig(top_k=4, depth=1, total_tokens=4))
    policy.EARLY_PLAIN_PROBES = ()
    spec = policy.plan(1)
    for _ in range(8):
        policy.observe(spec, [0], [1], seconds=0.025)                      # 2 tokens per request
        policy.observe(spec.alternative, [], [], seconds=0.010)
    lost = policy._measured_probe_loss(1)
    assert lost > policy.PROBE_EVERY
    assert policy._measured_probe_loss(2) == lost and policy._measured_probe_loss(4) == lost
    assert policy._probe_spacing(2, policy.plan(2)) >= min(math.ceil(lost), policy.PROBE_EVERY << policy.MAX_PRICED_BACKOFF)
    spec2 = policy.fitted_plan(2)
    spec2 = spec2 if spec2.speculate else spec2.alternative
    for _ in range(8):                                   # bucket 2 measures a burst that breaks even
        policy.observe(spec2, [0, 0], [1, 1], seconds=0.020)
        policy.observe(spec2.alternative, [], [], seconds=0.010)
    assert policy._measured_probe_loss(2) == 0.0 and policy._measured_probe_loss(1) == lost


def test_plain_bucket_backs_off_probes_that_keep_losing():
    """A bucket that decodes plainly probes speculation every PROBE_EVERY rounds with a burst of
    PROBE_BURST speculative rounds; each probe that loses again (fewer tokens per request per
    second than the plain steps) doubles the interval, up to 2 ** MAX_BACKOFF times; a probe that
    wins brings it back, and since a probe counts more than the measurements before it (the
    workload may have changed), the bucket speculates again within a few probes."""
    tables = _tables(easy_accept=0.7)
    cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    policy.PROBE_EVERY = 4
    policy.EARLY_PLAIN_PROBES = ()
    policy.PROBE_LOSS_SHARE = math.inf     # spacing by PROBE_EVERY alone (the priced spacing: above)
    spec = policy.plan(1)
    for _ in range(8):        # spec rounds slower than plain steps: the guard makes the bucket plain
        policy.observe(spec, [0], [1], seconds=0.050)
        policy.observe(spec.alternative, [], [], seconds=0.010)
    assert not policy.plan(1).speculate

    def run(rounds, seconds):
        kinds = []
        for n in range(rounds):
            p = policy.round_plan(1)
            kinds.append(p.speculate)
            if p.speculate:
                policy.observe(p, [0], [1], seconds=seconds)   # accepted as in the tables
            else:
                policy.observe(p, [], [], seconds=0.010)
        return kinds

    kinds = run(120, 0.025)                          # 80 % of the plain rate: whole bursts
    starts = [n for n, k in enumerate(kinds) if k and (n == 0 or not kinds[n - 1])]
    assert all(kinds[n:n + policy.PROBE_BURST] == [True] * policy.PROBE_BURST for n in starts[:-1])
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    want = [policy.PROBE_BURST - 1 + (policy.PROBE_EVERY << k) for k in (1, 2, 2, 2)]
    assert gaps[:4] == want                          # every probe lost: 4 -> 8 -> 16 -> 16 rounds
    # speculation now wins (4x plain steps); the guard lets it at once, the cost model's time
    # correction (learned on the slow rounds, forgotten over ~140 rounds) takes a while longer
    kinds = run(400, 0.005)
    assert policy.plan(1).speculate and policy._backoff[1] == 0
    assert not policy.realized_loses(1)
    # speculating, with a plain probe every 4th round (a plain bucket has stretches of 3+ plain rounds)
    assert "..." not in "".join("S" if k else "." for k in kinds[-100:])


def test_probe_burst_ends_early_when_speculation_loses_clearly():
    """A probe burst costs several rounds; when its first round already delivers less than
    PROBE_ABORT of the plain rate, it ends there and counts as a full (losing) measurement."""
    tables = _tables(easy_accept=0.7)
    policy = FittedPolicy(tables, LinearCost(a=10.0, b=1.0, c=0.5, e=0.5), SpecConfig(top_k=4, depth=1, total_tokens=4))
    policy.PROBE_EVERY = 4
    policy.EARLY_PLAIN_PROBES = ()
    policy.PROBE_LOSS_SHARE = math.inf     # spacing by PROBE_EVERY alone (the priced spacing: above)
    spec = policy.plan(1)
    for _ in range(8):
        policy.observe(spec, [0], [1], seconds=0.050)
        policy.observe(spec.alternative, [], [], seconds=0.010)
    kinds = []
    for _ in range(40):
        p = policy.round_plan(1)
        kinds.append(p.speculate)
        policy.observe(p, [0] if p.speculate else [], [1] if p.speculate else [],
                       seconds=0.050 if p.speculate else 0.010)     # 40 % of the plain rate
    text = "".join("S" if k else "." for k in kinds)
    assert "SS" not in text and text.count("S") >= 2                 # one round per probe
    assert policy.realized_loses(1) and policy._backoff[1] == policy.MAX_BACKOFF


def test_guard_verdict_carries_over_to_the_next_process():
    """A bucket the guard made plain starts plain in the next process (its saved state), instead
    of paying the rounds the guard needs before it acts again; a malformed entry is ignored."""
    tables, cost, cfg = _tables(easy_accept=0.7), LinearCost(a=10.0, b=1.0, c=0.5, e=0.5), \
        SpecConfig(top_k=4, depth=1, total_tokens=4)
    policy = FittedPolicy(tables, cost, cfg)
    spec = policy.plan(1)
    for _ in range(8):
        policy.observe(spec, [0], [1], seconds=0.050)
        policy.observe(spec.alternative, [], [], seconds=0.010)
    assert not policy.plan(1).speculate
    fresh = FittedPolicy(tables, cost, cfg)
    assert fresh.plan(1).speculate
    fresh.load_state(policy.state())
    assert not fresh.plan(1).speculate and fresh.realized(1) == policy.realized(1)
    bad = policy.state()
    bad["realized"]["1"] = [1.0, 2.0]
    other = FittedPolicy(tables, cost, cfg)
    other.load_state(bad)
    assert other.plan(1).speculate and other.state()["realized"] == {}


def test_array_search_helpers_match_their_scalar_definitions():
    g = torch.Generator().manual_seed(0)
    curves = torch.rand(5, 7, 6, generator=g).sort(dim=-1, descending=True).values.double().numpy()
    for scale in [(), (0.5,), (1.3, 0.9, 0.4), (2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.05)]:
        got = _corrected_accept_matrix(curves, scale)
        want = [corrected_accept(list(c), scale) for row in curves for c in row]
        assert got.ravel().tolist() == pytest.approx(want, abs=1e-12)
    fn = torch.rand(9, generator=g).double().numpy()
    probs = torch.rand(6, generator=g).double()
    probs = (probs / probs.sum()).numpy()
    values = torch.randint(0, 9, (20, 6), generator=g).numpy()
    for n in (1, 2, 5):
        got = _expected_of_max_rows(values, probs, n, fn)
        want = [_expected_fn_of_max(list(v), list(probs), n, lambda x: float(fn[x])) for v in values]
        assert got.tolist() == pytest.approx(want, abs=1e-12)


def _shipped_tables():
    from heterospec.defaults import DRAFT_ASSET_DIR
    tables = AcceptanceTables.find(str(DRAFT_ASSET_DIR))
    assert tables is not None, "the shipped draft has no acceptance tables"
    return tables


class _SmallRowCost:
    """A device where verifying a few tokens costs about one step and the draft is a large
    fraction of it (the 2-core AVX2 box's shape): deep trees do not pay, small ones do."""

    def verify_ms(self, B, nodes, context=256):
        return 50.0 + 2.0 * max(B * nodes - 4.0, 0.0)

    def draft_ms(self, B, forwards, extend_tokens=1.0):
        return 3.5 + (3.5 + 0.5 * B) * forwards + 0.2 * B * max(extend_tokens - 1.0, 0.0)

    def plain_ms(self, B, context=256):
        return 50.0 + 2.0 * max(B - 4.0, 0.0)


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("B", [1, 2, 4, 8, 16])
def test_fitted_plan_beats_every_action_taken_by_all_bins(B, ragged):
    """Per-bin actions can only add to one action for every bin (EAGLE-3's fixed tree is one of
    them): on the shipped tables, the fitted plan is at least as fast as the best uniform action
    under the same objective, ragged or padded, at every batch size (at batch > 1 the shortlist
    holds every option whose best uniform action is among the 3 fastest there)."""
    tables = _shipped_tables()
    for cost in (LinearCost(a=10.0, b=1.0, c=0.5, e=0.5), _SmallRowCost()):
        plan = fit_plan(tables, cost, B, margin=1.0, ragged=ragged)
        plan = plan if plan.speculate else plan.alternative
        got = plan.expected["speculative"]["tokens_per_s"]
        for opt in tables.options:
            probs = [c / sum(opt.counts) for c in opt.counts]
            for d, n, di, ni in _option_actions(tables, opt, None):
                acc = [sum(action_survival(tables, opt, i, di, ni)) for i in range(len(probs))]
                uni = plan_cost(cost, B, opt.decide_depth, probs, [d] * len(probs), [n] * len(probs), acc, 256,
                                ragged)["tokens_per_s"]
                assert got >= uni * (1 - 1e-9), (type(cost).__name__, opt.label, opt.decide_depth, d, n, got, uni)


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("B", [1, 2, 4, 8])
def test_fitted_plan_on_shipped_tables_is_a_local_optimum_of_plan_cost(B, ragged):
    """The array search against the scalar objective: on the shipped tables, no bin of the chosen
    option gains by any other action of the grid (batch 1: the separable optimum is global)."""
    tables = _shipped_tables()
    cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    plan = fit_plan(tables, cost, B, margin=1.0, ragged=ragged)
    plan = plan if plan.speculate else plan.alternative       # the best speculative plan either way
    opt = tables.options[plan.expected["option"]]
    probs = [c / sum(opt.counts) for c in opt.counts]
    acts = _option_actions(tables, opt, None)
    surv, _ = _survival_matrix(tables, opt, acts)
    chosen = [next(k for k, a in enumerate(acts) if (a[0], a[1] - 1) == (d, n))
              for d, n in zip(plan.depth, plan.budget)]

    def tps(choice):
        return plan_cost(cost, B, opt.decide_depth, probs, [acts[c][0] for c in choice], [acts[c][1] for c in choice],
                         [corrected_accept(surv[i][c], ()) for i, c in enumerate(choice)], 256, ragged)["tokens_per_s"]

    best = tps(chosen)
    assert best == pytest.approx(plan.expected["speculative"]["tokens_per_s"])
    for i in range(len(chosen)):
        if probs[i] == 0:
            continue
        for c in range(len(acts)):
            assert tps(chosen[:i] + [c] + chosen[i + 1:]) <= best * (1 + 1e-9), (i, acts[c])


def test_shortlist_shared_across_batch_sizes_gives_the_same_plans():
    tables, cost = _tables(), LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    shortlist = {}
    for B in (2, 4, 2, 8):
        a = fit_plan(tables, cost, B, shortlist=shortlist)
        b = fit_plan(tables, cost, B)
        assert (a.speculate, a.depth, a.budget, a.expected) == (b.speculate, b.depth, b.budget, b.expected)
    assert len(shortlist) == 4      # the batch-1 ranking once, and one shortlist per batch size


def _saved_cost_model(engine):
    """A small cost model of ``engine``'s device, saved where `heterospec costs` leaves one."""
    cm = costmodel.CostModel(
        fingerprint=costmodel.fingerprint(engine), tokens=[1, 64], contexts=[128], target=[[10.0, 12.0]],
        batch_sizes=[1], plain=[10.0], draft=[[0.01, 0.01, 0.0]], nodes=[1, 64], verify=[[10.0, 12.0]],
        tree_top_k=3)
    cm.save(costmodel.cache_path(cm.fingerprint))
    return cm


def test_online_corrections_persist_for_the_next_engine(tmp_path, monkeypatch):
    """What the fitted policy learned is saved next to this device's cached cost model and picked
    up by the next engine (process) on the same device, draft and tree."""
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    engine, draft, hf = _tiny_engine(seed=23)
    engine.tables = _tables_for(engine)
    cm = _saved_cost_model(engine)                         # as `heterospec costs` leaves it
    prompt = [5, 9, 17, 33]
    draft.set_prompts([prompt])
    engine.generate(prompt, max_new_tokens=12, method="heterospec", chat=False)
    pol = engine._policy("heterospec", engine.config, "fitted")
    assert sum(pol.state()["position"]["predicted"]) > 0
    saved = sorted((tmp_path / "costs").glob("*.online-*.json"))
    # the policy's corrections, and beside them the context-lookup gate's (heterospec.lookup)
    assert len(saved) == 2 and saved[1].name == saved[0].name.removesuffix(".json") + ".lookup.json"
    again, draft2, _ = _tiny_engine(seed=23)
    again.tables = engine.tables
    pol2 = again._policy("heterospec", again.config, "fitted")
    assert pol2.state() == pol.state() and pol2.state()["realized"]      # the guard's sums too
    draft2.set_prompts([prompt])
    again.generate(prompt, max_new_tokens=1, method="heterospec", chat=False)   # takes up the gate's state
    assert again.lookup_gate.state()["time"] == engine.lookup_gate.state()["time"]
    # A cost model handed over in memory is the caller's: nothing is written for it.
    other, _, _ = _tiny_engine(seed=23)
    other.tables, other.cost_model = engine.tables, cm
    other._policy("heterospec", other.config, "fitted")
    assert other._online_state_path(other.tables, other.config) is None


def test_learned_state_is_written_at_most_once_per_interval_and_at_exit(tmp_path, monkeypatch):
    """An engine's learned state (policy, lookup gate) is written by its first call, then at most
    once per SAVE_EVERY_S seconds a file; the newest held-back state is written by flush_saves
    (registered at exit), and nothing is written into a directory removed since."""
    from heterospec import _io
    monkeypatch.setattr(_io, "_last_save", {})
    monkeypatch.setattr(_io, "_held_saves", {})
    clock = [100.0]
    monkeypatch.setattr(_io.time, "monotonic", lambda: clock[0])
    writes = []
    path = str(tmp_path / "state.json")

    def save(tag):
        return lambda: writes.append(tag)

    assert _io.save_throttled(path, save("a")) and writes == ["a"]       # first: at once
    clock[0] += _io.SAVE_EVERY_S / 2
    assert not _io.save_throttled(path, save("b")) and writes == ["a"]   # held back ...
    assert not _io.save_throttled(path, save("c"))                        # ... the newest replaces it
    assert _io.save_throttled(str(tmp_path / "other.json"), save("x"))   # per file
    clock[0] += _io.SAVE_EVERY_S
    assert _io.save_throttled(path, save("d")) and writes == ["a", "x", "d"]   # due: the newest, "c" dropped
    clock[0] += 1.0
    assert not _io.save_throttled(path, save("e"))
    _io.flush_saves()
    assert writes == ["a", "x", "d", "e"]
    _io.flush_saves()                                                      # nothing held: nothing runs
    assert writes == ["a", "x", "d", "e"]
    gone = tmp_path / "gone"
    gone.mkdir()
    assert _io.save_throttled(str(gone / "s.json"), save("f"))
    assert not _io.save_throttled(str(gone / "s.json"), save("g"))
    gone.rmdir()
    _io.flush_saves()
    assert writes[-1] == "f"


def test_an_engine_writes_its_learned_state_after_the_interval(tmp_path, monkeypatch):
    """The engine's calls go through save_throttled: a second call inside the interval leaves the
    file as the first call wrote it; flush_saves writes the second call's state."""
    from heterospec import _io
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(_io, "_last_save", {})
    monkeypatch.setattr(_io, "_held_saves", {})
    monkeypatch.setattr(_io, "SAVE_EVERY_S", 3600.0)
    engine, draft, _ = _tiny_engine(seed=23)
    engine.tables = _tables_for(engine)
    _saved_cost_model(engine)
    prompt = [5, 9, 17, 33]
    draft.set_prompts([prompt])
    engine.generate(prompt, max_new_tokens=6, method="heterospec", chat=False)
    pol = engine._policy("heterospec", engine.config, "fitted")
    with open(pol.state_path) as f:
        first = json.load(f)
    engine.generate(prompt, max_new_tokens=6, method="heterospec", chat=False)
    with open(pol.state_path) as f:
        assert json.load(f) == first                  # held back
    assert pol.state() != first                       # (the second call did learn)
    _io.flush_saves()
    with open(pol.state_path) as f:
        assert json.load(f) == json.loads(json.dumps(pol.state()))


def _in_use_model(engine, plain=(20.0, 40.0)):
    return costmodel.CostModel(
        fingerprint=costmodel.fingerprint(engine), tokens=[1, 64], contexts=[128], target=[[10.0, 12.0]],
        batch_sizes=[1, 2], plain=list(plain), draft=[[0.5, 0.5, 0.1], [0.6, 0.6, 0.1]], nodes=[1, 64],
        verify=[[10.0, 12.0], [11.0, 14.0]], tree_top_k=3, provenance={"date": "monday"})


def test_cost_model_in_use_factors_price_every_phase():
    """The in-use factors (the engine's rounds over the curves) multiply the plain step by the
    plain factor and a round's draft and verify by the round factor, interpolated in log2(B)
    between the batch sizes measured and the nearest one's outside them; a model without them
    (every file written before them) prices the curves alone, and the stamp the online
    corrections are kept against moves with them."""
    engine, _, _ = _tiny_engine()
    raw = _in_use_model(engine)
    cm = costmodel.CostModel(**{k: v for k, v in raw.to_dict().items() if k != "format"})
    cm.in_use = {"batch_sizes": [1, 4], "round": [1.2, 0.8], "plain": [0.7, 0.9], "date": "tuesday"}
    assert cm.in_use_factor("plain", 1) == pytest.approx(0.7) and cm.in_use_factor("round", 4) == pytest.approx(0.8)
    assert cm.in_use_factor("plain", 2) == pytest.approx(0.8) and cm.in_use_factor("round", 2) == pytest.approx(1.0)
    assert cm.in_use_factor("plain", 16) == pytest.approx(0.9) and raw.in_use_factor("plain", 2) == 1.0
    for B in (1, 2, 3, 8):
        assert cm.plain_ms(B) == pytest.approx(raw.plain_ms(B) * cm.in_use_factor("plain", B))
        assert cm.draft_ms(B, 3, 2.0) == pytest.approx(raw.draft_ms(B, 3, 2.0) * cm.in_use_factor("round", B))
        assert cm.verify_ms(B, 5, 512) == pytest.approx(raw.verify_ms(B, 5, 512) * cm.in_use_factor("round", B))
    d = raw.to_dict()
    d.pop("in_use")
    old = costmodel.CostModel(**{k: v for k, v in d.items() if k != "format"})
    assert old.in_use == {} and old.plain_ms(2) == raw.plain_ms(2)
    assert raw.stamp == "monday" and cm.stamp == "monday in use tuesday"
    tables = _tables()
    cfg = SpecConfig(top_k=4, depth=3, total_tokens=8)
    assert FittedPolicy(tables, cm, cfg).state()["cost_model"] == "monday in use tuesday"


def test_forced_policy_runs_one_kind_of_round(tmp_path):
    """ForcedPolicy: every round speculative (the guard never turns it plain), or every round a
    plain step; greedy output the target's either way."""
    from heterospec.policy import ForcedPolicy
    engine, draft, _ = _tiny_engine(seed=23)
    tables = _tables_for(engine)
    cm = _in_use_model(engine, plain=(0.001, 0.002))    # plain steps priced nearly free: plain would win
    prompt = [5, 9, 17, 33]
    draft.set_prompts([prompt])
    ar = engine.generate(prompt, max_new_tokens=16, method="autoregressive", chat=False)
    for speculate in (True, False):
        pol = ForcedPolicy(tables, cm, engine.config, speculate=speculate, ragged=engine.ragged_verify)
        draft.set_prompts([prompt])
        out = engine.generate(prompt, max_new_tokens=16, method="heterospec", chat=False, policy=pol, lookup=False)
        assert out.token_ids == ar.token_ids
        assert all(r.plain != speculate for r in out.stats.records), [r.plain for r in out.stats.records]
        assert pol.time_sums(speculate) and not pol.time_sums(not speculate)


def test_measure_in_use_times_the_engines_rounds_against_the_curves(monkeypatch):
    """measure_in_use: per batch size the engine's timed rounds over the model's predictions, per
    kind, set on the model; with every round timed at 30 ms the plain factor is 30 ms over the
    model's plain step (within IN_USE_BAND)."""
    engine, draft, _ = _tiny_engine(seed=23)
    engine.tables = _tables_for(engine)
    cm = _in_use_model(engine)
    cm.in_use = {"batch_sizes": [1], "round": [2.0], "plain": [2.0]}       # replaced, not compounded
    monkeypatch.setattr(engine, "_round_seconds", lambda *a, **k: 0.03)
    monkeypatch.setattr(costmodel, "IN_USE_TOKENS", 24)
    prompts = [[5 + i, 9, 17 + i, 33] for i in range(4)]
    draft.set_prompts(prompts)
    got = costmodel.measure_in_use(engine, cm, prompts, max_new_tokens=24, progress=False)
    assert got is cm.in_use and got["batch_sizes"] == [1, 2]
    assert got["plain"] == [pytest.approx(1.5), pytest.approx(0.75)]
    assert all(costmodel.IN_USE_BAND[0] <= r <= costmodel.IN_USE_BAND[1] for r in got["round"])
    assert all(n >= costmodel.IN_USE_MIN_ROUNDS for pair in got["rounds"] for n in pair)
    with pytest.raises(ValueError, match="acceptance tables"):
        costmodel.measure_in_use(_tiny_engine()[0], cm, prompts, progress=False)

    with pytest.raises(ValueError, match="repeats"):
        costmodel.measure_in_use(engine, cm, prompts, repeats=0, progress=False)


def test_measure_in_use_takes_the_median_over_repeats(monkeypatch):
    """One disturbed repeat (every round 10x slower) does not move the factors: they are the
    median over the repeats, each timed with fresh policies."""
    import heterospec.policy as policy_mod
    engine, draft, _ = _tiny_engine(seed=23)
    engine.tables = _tables_for(engine)
    cm = _in_use_model(engine)
    made = []

    class Counted(policy_mod.ForcedPolicy):
        def __init__(self, *a, **k):
            made.append(self)
            super().__init__(*a, **k)

    monkeypatch.setattr(policy_mod, "ForcedPolicy", Counted)
    # policies 0-1: the untimed warm-up; 2-3, 4-5, 6-7: the repeats; the second one disturbed
    monkeypatch.setattr(engine, "_round_seconds", lambda *a, **k: 0.3 if len(made) in (5, 6) else 0.03)
    prompts = [[5 + i, 9, 17 + i, 33] for i in range(4)]
    draft.set_prompts(prompts)
    got = costmodel.measure_in_use(engine, cm, prompts, max_new_tokens=24, repeats=3, progress=False)
    assert len(made) == 8 and got["repeats"] == 3
    assert got["plain"] == [pytest.approx(1.5), pytest.approx(0.75)]


def _tables_for(engine):
    """Tables for the tiny engine's tree (top_k 3) from the synthetic ones."""
    t = _tables()
    t.top_k = engine.config.top_k
    return t


def test_chain_tables_for_vllm(tmp_path):
    """`heterospec calibrate --chain`: tables for a chain drafter (top_k 1), read after the first
    draft forward, with the accepted length of every chain length; exact against a direct count."""
    from heterospec.calibrate import calibrate_chain_tables
    from heterospec.policy import CHAIN_TABLES_FILENAME

    hf = tiny_hf_llama(seed=29)
    draft = OracleDraft(hf, noise=1.0, seed=5)
    engine = Engine(hf, draft, config=SpecConfig(top_k=1, depth=3, total_tokens=5))
    engine.draft_dir = tmp_path
    prompts = [[7 + i, 11, 19 + i, 31] for i in range(8)]
    draft.set_prompts(prompts)
    with pytest.raises(ValueError, match="top_k=1"):
        calibrate_chain_tables(_tiny_engine()[0], prompts, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tables = calibrate_chain_tables(engine, prompts, max_new_tokens=16, max_draft_tokens=6, progress=False,
                                        batch_size=8, out_dir=str(tmp_path))
    assert AcceptanceTables.load(str(tmp_path / CHAIN_TABLES_FILENAME)).to_dict() == tables.to_dict()
    assert tables.top_k == 1 and tables.depths == list(range(6)) and tables.nodes == list(range(1, 8))
    assert {o.decide_depth for o in tables.options} == {0} and {o.entropy_k for o in tables.options} == {4, 8}
    assert tables.provenance["shape"] == "chain"
    for o in tables.options:
        for b, tab in enumerate(o.accept):
            if o.counts[b]:
                t = torch.tensor(tab)
                # a chain of d + 1 drafts verified with n - 1 >= d + 1 nodes accepts at most d + 1 and
                # never less with more nodes; verifying the root only accepts nothing
                assert (t[:, 0] == 0).all() and (t[:, 1:] >= t[:, :-1] - 1e-9).all()
                for d in range(6):
                    assert (t[d] <= d + 1 + 1e-9).all()
                    assert torch.allclose(t[d, d + 2:], t[d, d + 1].expand(t[d, d + 2:].shape))


def test_bin_scale_keeps_an_easy_bin_easy_when_another_bin_fails():
    """The tables say bin 1 accepts 0.6 per layer; on this workload it accepts nothing, while
    bin 0 accepts as calibrated. The position scale alone drags both bins down (it is one ratio
    per position); the per-bin factor gives bin 0 back its acceptance and bin 1 its failure."""
    tables = _tables(easy_accept=0.9, hard_accept=0.6, counts=(50, 50))
    cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)

    def run(with_bins):
        policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
        if not with_bins:
            policy.bin_scale = lambda: {}
        for r in range(300):
            plan = policy.plan(1)
            if not plan.speculate:
                plan = plan.alternative
            b = r % 2
            n = len(plan.survival[b])
            accepted = 0 if b == 1 or r % 20 == 0 else n       # bin 0: ~0.9 of rounds accept all
            policy.observe(plan, [b], [accepted])
        return policy, policy.plan(1)

    policy, plan = run(True)
    scale = policy.bin_scale()[0]
    assert scale[0] >= 1.0 and scale[1] <= 0.5
    _, without = run(False)
    assert plan.speculate
    # bin 0's predicted acceptance is back near what it delivers; without the factors it is not
    assert plan.predicted_accept[0] > 1.2 * without.predicted_accept[0]
    assert plan.predicted_accept[1] <= 0.1
    # the state round-trips (the engine keeps it between processes)
    again = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    again.load_state(json.loads(json.dumps(policy.state())))
    assert again.bin_scale() == policy.bin_scale()


def test_bin_factors_are_recomputed_only_when_acceptance_evidence_arrives():
    """bin_scale / bin_frequencies are cached between speculative observations (plain steps bring
    no acceptance evidence); a cached value always equals a fresh computation."""
    tables = _tables(easy_accept=0.9, hard_accept=0.6, counts=(50, 50))
    cost = LinearCost(a=10.0, b=1.0, c=0.5, e=0.5)
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    plain = Plan("plain", speculate=False, expected={"batch_size": 1, "plain": {"ms": 10.0}})
    for r in range(120):
        plan = policy.plan(1)
        plan = plan if plan.speculate else plan.alternative
        b = r % 2
        policy.observe(plan, [b], [0 if b else len(plan.survival[b])])
        if r % 3 == 0:
            before = policy._evidence
            policy.observe(plain, [], [], 0.01)                      # a plain step: no new evidence
            assert policy._evidence == before
        cached_scale, cached_freq = policy.bin_scale(), policy.bin_frequencies()
        policy._derived.clear()
        assert policy.bin_scale() == cached_scale and policy.bin_frequencies() == cached_freq, r
    assert policy.bin_scale()[0] != (1.0, 1.0)          # the evidence did move the factors
    n = policy._evidence
    again = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    again.bin_scale()
    again.load_state(json.loads(json.dumps(policy.state())))
    assert again.bin_scale() == policy.bin_scale() and n > 100


def test_calibration_files_per_tree(tmp_path):
    """A draft directory holds the calibrations of several trees (the CPU's (4, 3, 8) and the
    GPU's (10, 7, 60)): the first keeps the historical names, a second tree gets tagged names and
    never replaces the first, and each engine finds the files of its own tree."""
    from heterospec._io import find_tree_file
    from heterospec.config import SpecConfig
    from heterospec.entropy import EntropyBins, bins_path_to_write

    d = str(tmp_path)

    def tables(k):
        return AcceptanceTables(k, [0], [1], [BinningOption(0, k, "accept", [], [1], [[[0.0]]])], {"top_k": k})

    cpu, gpu = SpecConfig(top_k=4, depth=3, total_tokens=8), SpecConfig(top_k=10, depth=7, total_tokens=60)
    assert AcceptanceTables.path_to_write(d, 4).endswith("/acceptance_tables.json")
    tables(4).save(AcceptanceTables.path_to_write(d, 4))
    assert AcceptanceTables.path_to_write(d, 4).endswith("/acceptance_tables.json")        # same tree: again
    assert AcceptanceTables.path_to_write(d, 10).endswith("/acceptance_tables_k10.json")   # another tree
    tables(10).save(AcceptanceTables.path_to_write(d, 10))
    assert AcceptanceTables.find(d, 4).top_k == 4 and AcceptanceTables.find(d, 10).top_k == 10
    assert AcceptanceTables.find(d).top_k == 4 and AcceptanceTables.find(d, 6).top_k == 4   # the caller compares
    assert AcceptanceTables.find(str(tmp_path / "none"), 4) is None

    def bins(cfg, edge):
        return EntropyBins([edge], provenance={"tree": {"depth": cfg.depth, "entropy_k": cfg.resolved_entropy_k}})
    bins(cpu, 0.5).save(bins_path_to_write(d, cpu))
    gp = bins_path_to_write(d, gpu)
    assert gp.endswith(f"/entropy_bins_d7_k{gpu.resolved_entropy_k}.json")
    bins(gpu, 2.5).save(gp)
    assert EntropyBins.find(d, cpu).edges == [0.5] and EntropyBins.find(d, gpu).edges == [2.5]
    assert find_tree_file(d, "entropy_bins.json", None).endswith("/entropy_bins.json")

    # the engine: tables for each call's tree, the ones set on it for a tree without a file
    engine, _, _ = _tiny_engine(seed=3)
    engine.draft_dir = d
    assert engine.tables_for(10).top_k == 10 and engine.tables_for(4).top_k == 4
    engine.tables = tables(3)
    assert engine.tables_for(3).top_k == 3 and engine.tables_for(10).top_k == 10
    assert engine.tables_for(7).top_k == 3           # no file for 7: the tables given


@pytest.mark.parametrize("top_k,depth,total", [(4, 3, 8), (10, 7, 60)])
def test_shipped_draft_is_calibrated_for_the_cpu_and_the_gpu_tree(top_k, depth, total):
    """Both device defaults find acceptance tables and entropy bins of their own tree next to the
    shipped draft (the GPU run of 26 Nov fell back to the paper's actions and warned that its bins
    were for depth 3 and K 4)."""
    from heterospec.defaults import DRAFT_ASSET_DIR
    cfg = SpecConfig(top_k=top_k, depth=depth, total_tokens=total)
    tables = AcceptanceTables.find(str(DRAFT_ASSET_DIR), top_k)
    assert tables is not None and tables.top_k == top_k
    assert tables.provenance["tree"] == {"top_k": top_k, "depth": depth, "total_tokens": total,
                                         "pstar_pool": cfg.pstar_pool}
    assert tables.provenance["rounds"] >= 1000 and all(sum(o.counts) == tables.provenance["rounds"]
                                                       for o in tables.options)
    bins = EntropyBins.find(str(DRAFT_ASSET_DIR), cfg, quiet=True)
    tree = bins.provenance["tree"]
    assert (tree["depth"], tree["entropy_k"]) == (depth, cfg.resolved_entropy_k)


def test_bin_factors_recompute_only_the_options_observed_and_equal_a_full_recomputation():
    """bin_scale / bin_frequencies recompute only the binning options observed since they last
    ran (all of them when the position scale moved or a state was loaded); the result always
    equals recomputing every option."""
    import random

    tables, cost = _tables_of_options(), LinearCost(a=10.0, b=0.3, c=0.2, e=0.2)
    policy = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    plans = []
    for i in range(len(tables.options)):
        plan = fit_plan(tables, cost, 1, options=[i])
        plan = plan if plan.speculate else plan.alternative
        assert plan.expected["option"] == i
        plans.append(plan)
    rng = random.Random(5)
    recomputed = 0
    for r in range(400):
        plan = plans[rng.randrange(2) if r < 200 else rng.randrange(len(plans))]   # later: every option
        b = rng.randrange(plan.num_bins)
        policy.observe(plan, [b], [rng.randrange(len(plan.survival[b]) + 1)])
        incremental = policy._scale_dirty is not None and policy.position_scale() == policy._scale_pos
        scale, freq = policy.bin_scale(), policy.bin_frequencies()
        policy._derived.clear()
        policy._freq_dirty = policy._scale_dirty = None
        assert policy.bin_scale() == scale and policy.bin_frequencies() == freq, r
        recomputed += incremental
    assert recomputed > 100          # most rounds took the incremental path
    assert len(policy.bin_scale()) == len(tables.options)
    again = FittedPolicy(tables, cost, SpecConfig(top_k=4, depth=1, total_tokens=4))
    again.load_state(json.loads(json.dumps(policy.state())))
    assert again.bin_scale() == policy.bin_scale() and again.bin_frequencies() == policy.bin_frequencies()


def test_plain_steps_timed_under_other_load_do_not_keep_a_bucket_speculating():
    """The sixty-eighth session's batch sweep: plain steps timed while another process held a
    core (1.7x their cost) made speculation, which loses 9 % on a quiet machine, look a clear
    win; with probes every 256 rounds the guard's plain evidence kept those steps for thousands
    of rounds. Aged by every speculative round (PLAIN_AGE), it follows the probes: the bucket
    turns plain within a few probes, and the plain-step correction comes back to the truth.
    Without ageing (PLAIN_AGE 1) the same run speculates at a loss for ~1,600 rounds."""
    def run(age):
        policy = FittedPolicy(_tables(easy_accept=0.7), LinearCost(a=10.0, b=1.0, c=0.5, e=0.5),
                              SpecConfig(top_k=4, depth=1, total_tokens=4))
        policy.PLAIN_AGE = age
        spec = policy.plan(1)
        assert spec.speculate
        p_ms = spec.alternative.expected["plain"]["ms"]
        for _ in range(30):   # the contended start: speculative rounds as on a quiet box, plain steps at 1.7x
            policy.observe(spec, [0], [1], seconds=1e-3 * 2.2 * p_ms)
            policy.observe(spec.alternative, [], [], seconds=1e-3 * 1.7 * p_ms)
        kinds = []
        for _ in range(2000):   # quiet: a plain step costs p_ms, a round gives 2 tokens in 2.2 p_ms
            p = policy.round_plan(1, tokens_left=1000)
            kinds.append(p.speculate)
            policy.observe(p, [0] if p.speculate else [], [1] if p.speculate else [],
                           seconds=1e-3 * (2.2 if p.speculate else 1.0) * p_ms)
        return policy, kinds

    aged, kinds = run(FittedPolicy.PLAIN_AGE)
    assert FittedPolicy.PLAIN_AGE < 1.0
    assert sum(kinds[-1000:]) < 50                    # plain but for the probe bursts
    assert aged.realized_loses(1) and not aged.plan(1).speculate
    assert aged.plain_scale(1) <= 1.1                  # the correction followed the probes
    assert sum(kinds[:1000]) < 500
    stale, kinds = run(1.0)
    assert sum(kinds[:1500]) > 1400
