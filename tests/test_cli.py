"""The `heterospec` command line on a tiny pair saved to disk (with the SmolLM2 tokenizer)."""

import importlib
import json
import math
import os
import re
import shutil

import pytest
import torch

import heterospec
import heterospec.engine
from heterospec.cli import main
from tests.engine_util import tiny_hf_llama


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    from heterospec.defaults import ModelPackageMissing, default_target_dir
    try:
        smol = default_target_dir()
    except ModelPackageMissing as e:     # only a missing package skips; a broken conversion fails
        pytest.skip(f"needs the SmolLM2 tokenizer of the built-in target: {e}")
    root = tmp_path_factory.mktemp("pair")
    tdir, ddir = root / "target", root / "draft"
    hf = tiny_hf_llama(vocab=49152, hidden=32, layers=3, heads=4, kv_heads=2, dtype=torch.float32, seed=0)
    hf.config.eos_token_id = 2
    hf.save_pretrained(tdir)
    for f in os.listdir(smol):
        if f.startswith("tokenizer") or f in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(os.path.join(smol, f), tdir / f)
    target = heterospec.TargetModel.from_pretrained(str(tdir))
    heterospec.Eagle3Draft.for_target(target, draft_vocab_size=4096, seed=0).save_pretrained(str(ddir))
    return str(tdir), str(ddir)


def test_generate_all_methods(pair_dirs, capsys):
    t, d = pair_dirs
    rc = main(["generate", "Say hi.", "--target", t, "--draft", d, "--method", "all", "--max-new-tokens", "6",
               "--tree-top-k", "3", "--depth", "2", "--total-tokens", "6"])
    out = capsys.readouterr()
    assert rc == 0
    for m in ("autoregressive", "eagle3", "heterospec"):
        assert f"[{m}]" in out.err and "tau" in out.err


def test_generate_stream_and_sampling(pair_dirs, capsys):
    t, d = pair_dirs
    rc = main(["generate", "Count to three.", "--target", t, "--draft", d, "--stream", "--temperature", "0.8",
               "--seed", "1", "--max-new-tokens", "5"])
    assert rc == 0 and "[heterospec] 5 tokens" in capsys.readouterr().err
    rc = main(["generate", "Count to three.", "--target", t, "--draft", d, "--max-new-tokens", "5", "--no-lookup"])
    assert rc == 0 and "context-lookup" not in capsys.readouterr().err


def test_calibrate_writes_bins(pair_dirs, tmp_path, capsys):
    t, d = pair_dirs
    rc = main(["calibrate", "--target", t, "--draft", d, "--n", "3", "--max-new-tokens", "12", "--out", str(tmp_path),
               "--tree-top-k", "3", "--depth", "2", "--total-tokens", "6"])
    assert rc == 0
    data = json.loads((tmp_path / "entropy_bins.json").read_text())
    assert data["edges"] == sorted(data["edges"]) and data["provenance"]["prompts"] == 3
    assert "calibration split" in data["provenance"]["prompt_source"]


def test_bench_writes_tables_and_plots(pair_dirs, tmp_path, capsys):
    pytest.importorskip("heterospec.datasets")
    from heterospec.datasets import MissingDataError, load_prompts
    try:
        load_prompts("humaneval", n=1)
    except MissingDataError as e:
        pytest.skip(str(e))
    t, d = pair_dirs
    rc = main(["bench", "--target", t, "--draft", d, "--sets", "humaneval", "--n", "1", "--max-new-tokens", "6",
               "--out", str(tmp_path), "--tree-top-k", "3", "--depth", "2", "--total-tokens", "6"])
    assert rc == 0
    res = json.loads((tmp_path / "e2e.json").read_text())
    assert set(res["summary"]["humaneval"]) == {"autoregressive", "eagle3", "heterospec"}
    assert res["meta"]["greedy_mismatches"] == []
    for f in ("e2e.md", "speedup.png", "entropy_bins.png"):
        assert (tmp_path / f).exists(), f
    assert "autoregressive: 0" in (tmp_path / "e2e.md").read_text()
    # without the autoregressive baseline nothing is compared, and the report says so
    only = tmp_path / "only"
    rc = main(["bench", "--target", t, "--draft", d, "--sets", "humaneval", "--n", "1", "--max-new-tokens", "4",
               "--methods", "eagle3", "--out", str(only), "--tree-top-k", "3", "--depth", "2", "--total-tokens", "6"])
    assert rc == 0
    md = (only / "e2e.md").read_text()
    assert "not checked" in md and "nan" not in md


def test_bad_arguments(pair_dirs, capsys):
    t, d = pair_dirs
    with pytest.raises(SystemExit):
        main(["generate", "x", "--method", "medusa"])
    for argv, msg in ((["generate", "x", "--draft", d], "--draft needs --target"),
                      (["generate", "x", "--target", t, "--draft", d, "--temperature", "-1"], "--temperature"),
                      (["generate", "x", "--target", str(t) + "-missing"], "no such directory")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_model_dir_without_weights_is_one_line_error(pair_dirs, capsys, monkeypatch):
    """A draft directory passed as the target: found only while loading (KeyError), reported in one line."""
    monkeypatch.delenv("HETEROSPEC_DEBUG", raising=False)
    t, d = pair_dirs
    assert main(["generate", "x", "--target", d, "--method", "autoregressive", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("heterospec: error: ") and "missing weights" in err
    assert "Traceback" not in err and not err.startswith("heterospec: error: \"")


def test_from_pretrained_draft_dtype(pair_dirs):
    t, d = pair_dirs
    eng = heterospec.Engine.from_pretrained(t, d, draft_dtype=torch.bfloat16)
    assert eng.draft.dtype == torch.bfloat16 and eng.target.lm_head.weight.dtype == torch.float32
    eng = heterospec.Engine.from_pretrained(t, d, draft_dtype=torch.float32)
    assert eng.draft.dtype == torch.float32
    ref = eng.generate("Say hi.", max_new_tokens=6, method="autoregressive").token_ids
    assert eng.generate("Say hi.", max_new_tokens=6, method="eagle3").token_ids == ref
    assert eng.draft_dtype_report == {}          # given, not measured


def test_a_draft_with_q8_0_weights_streams_codes_and_is_lossless(pair_dirs):
    from heterospec.models.linear import coded_formats
    t, d = pair_dirs
    eng = heterospec.Engine.from_pretrained(t, d, draft_dtype="q8_0")
    assert eng.draft.weight_form == "q8_0" and eng.draft.dtype == torch.float32
    assert "q8_0" in coded_formats([eng.draft])                  # the tuned linears stream its codes
    ref = eng.generate("Say hi.", max_new_tokens=8, method="autoregressive").token_ids
    for m in ("eagle3", "heterospec"):
        assert eng.generate("Say hi.", max_new_tokens=8, method=m).token_ids == ref
    with pytest.raises(ValueError, match="draft_dtype must be one of .*q8_0"):
        heterospec.Engine.from_pretrained(t, d, draft_dtype="q4")


def test_the_draft_may_run_as_q8_0_where_timed_faster(pair_dirs, monkeypatch, tmp_path):
    """The q8_0 candidate is timed like a dtype: kept where faster, and a cached choice converts a
    fresh engine's draft in place; the cost model's fingerprint names the form."""
    from heterospec import costmodel
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costmodel, "draft_round_ms", lambda eng, drafts, **kw: [4.0, 2.0])
    # a quiet machine: a choice timed while other processes (the suite's other worker) keep it busy
    # is not cached, by design (tests/test_engine.py tests that)
    monkeypatch.setattr(costmodel.OtherLoad, "cores", lambda self: 0.0)
    t, d = pair_dirs
    eng = heterospec.Engine.from_pretrained(t, d, draft_dtype=torch.float32, linear="stock")
    want = {k: v.clone() for k, v in eng.draft.state_dict().items()}
    report = costmodel.choose_draft_dtype(eng, [torch.float32, "q8_0"], progress=False)
    assert report["chosen"] == "q8_0" and not report["cached"] and set(report["ms"]) == {"float32", "q8_0"}
    assert eng.draft.weight_form == "q8_0" and costmodel.fingerprint(eng)["draft_dtype"] == "q8_0"
    w = eng.draft.lm_head.weight
    assert not torch.equal(w, want["lm_head.weight"]) and torch.allclose(w, want["lm_head.weight"], atol=2e-3)

    def no_timing(*a, **kw):
        raise AssertionError("a cached choice is not timed again")
    monkeypatch.setattr(costmodel, "draft_round_ms", no_timing)
    fresh = heterospec.Engine.from_pretrained(t, d, draft_dtype=torch.float32, linear="stock")
    assert costmodel.choose_draft_dtype(fresh, [torch.float32, "q8_0"], progress=False)["cached"]
    assert fresh.draft.weight_form == "q8_0"
    assert all(torch.equal(v, eng.draft.state_dict()[k]) for k, v in fresh.draft.state_dict().items())


def test_from_pretrained_measures_the_draft_dtype(pair_dirs, monkeypatch, tmp_path):
    """A bfloat16 target on a CPU that emulates bf16 may draft in float32: both are timed, the
    faster kept; a float32 target's draft runs in float32 without timing. (Stock linears: the
    choice does not depend on them, and tuning them in three fresh caches took most of the time.)"""
    from heterospec import costmodel, engine as eng_mod
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(eng_mod, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(costmodel, "draft_round_ms", lambda eng, drafts, **kw: [4.0, 2.0])
    t, d = pair_dirs
    eng = heterospec.Engine.from_pretrained(t, d, dtype=torch.bfloat16, linear="stock")
    assert eng.draft_dtype_report["chosen"] == "float32" and eng.draft.dtype == torch.float32
    # the float32 candidate holds the float16 file's exact values
    ref = heterospec.Engine.from_pretrained(t, d, draft_dtype=torch.float32, linear="stock")
    assert all(torch.equal(v, ref.draft.state_dict()[k]) for k, v in eng.draft.state_dict().items())
    monkeypatch.setattr(costmodel, "draft_round_ms", lambda eng, drafts, **kw: [2.0, 4.0])
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path / "other"))
    eng = heterospec.Engine.from_pretrained(t, d, dtype=torch.bfloat16, linear="stock")
    assert eng.draft_dtype_report["chosen"] == "bfloat16" and eng.draft.dtype == torch.bfloat16
    monkeypatch.setattr(eng_mod, "cpu_has_native_bf16", lambda: True)

    def no_timing(*a, **kw):
        raise AssertionError("a single candidate is not timed")
    monkeypatch.setattr(costmodel, "draft_round_ms", no_timing)
    eng = heterospec.Engine.from_pretrained(t, d, dtype=torch.float32, linear="stock")
    assert eng.draft.dtype == torch.float32


def test_markdown_table_without_reference_methods():
    from heterospec.bench import markdown_table, summarize
    rec = {"accept_len": 1, "depth": 3}
    run = dict(set="s", method="eagle3", new_tokens=10, total_s=1.0, prefill_s=0.1, rounds=5, target_calls=5,
               verified_tokens=40, draft_s=0.2, verify_s=0.5, records=[rec] * 5)
    s = summarize([run])
    assert math.isnan(s["s"]["eagle3"]["speedup"]) and s["s"]["eagle3"]["vs_eagle3"] == 1.0
    table = markdown_table(s, ["eagle3"])
    assert "nan" not in table and "| - |" in table and "| 1.000x |" in table
    assert s["s"]["eagle3"]["tau"] == 2.0 and s["s"]["eagle3"]["acceptance_rates"] == [1.0, 0.0, 0.0]


def test_mean_speedups_get_intervals_from_prompts_drawn_within_their_set():
    """run_e2e's mean rows: the mean over sets of each method's ratio, with a bootstrap interval
    whose units are prompts (every method decoded each one), drawn within their set; where every
    prompt of a set gives the same ratio the interval is that mean itself."""
    from heterospec.bench import markdown_table, mean_intervals, summarize

    rec = {"accept_len": 0, "depth": 0}
    runs = []
    # set a: heterospec 2x autoregressive on every prompt; set b: 1x; eagle3 at 1x everywhere
    for name, factor in (("a", 2.0), ("b", 1.0)):
        for i, slow in enumerate((1.0, 3.0, 0.5)):          # prompts at different speeds of the machine
            for method, t in (("autoregressive", slow), ("eagle3", slow), ("heterospec", slow / factor)):
                runs.append(dict(set=name, prompt_id=i, method=method, new_tokens=10, total_s=t, prefill_s=0.0,
                                 rounds=1, target_calls=1, verified_tokens=1, draft_s=0.0, verify_s=0.0, records=[rec]))
    ci = mean_intervals(runs, ["heterospec", "eagle3", "autoregressive"])
    assert ci["heterospec"]["speedup"] == pytest.approx([1.5, 1.5]) and ci["heterospec"]["vs_eagle3"] == pytest.approx([1.5, 1.5])
    assert ci["eagle3"]["speedup"] == pytest.approx([1.0, 1.0]) and ci["eagle3"]["vs_eagle3"] is None
    assert ci["autoregressive"]["speedup"] is None
    table = markdown_table(summarize(runs), ["heterospec", "eagle3", "autoregressive"], ci)
    assert "| **mean** | heterospec | | 1.50x (1.50-1.50) | 1.500x (1.500-1.500) |" in table
    assert "90% bootstrap interval, prompts drawn within their set" in table
    # a set of one prompt gives no interval (and no line about one)
    one = [r for r in runs if r["prompt_id"] == 0]
    assert mean_intervals(one, ["heterospec"])["heterospec"]["speedup"] is None
    assert "bootstrap" not in markdown_table(summarize(one), ["heterospec"], mean_intervals(one, ["heterospec"]))


def test_host_time_outside_the_rounds_is_reported():
    """Per call: the policy's own time (planning and learning), and the table's host columns
    (policy, and the wall time left after prefill, draft, verify and policy), so a benchmark
    shows where a method spends time outside its rounds (the H100 run: heterospec 1.8 s, eagle3
    0.6 s of 6.2 / 4.1)."""
    from heterospec import Engine, SpecConfig
    from heterospec.bench import markdown_table, summarize
    from heterospec.entropy import EntropyBins

    target = heterospec.TargetModel.from_hf(tiny_hf_llama(seed=3))
    engine = Engine(target, heterospec.Eagle3Draft.for_target(target, seed=3),
                    config=SpecConfig(top_k=3, depth=2, total_tokens=6), bins=EntropyBins([0.5, 1.0, 2.0]))
    runs = []
    for method in ("eagle3", "heterospec", "autoregressive"):
        r = engine.generate([5, 9, 17, 33], max_new_tokens=12, method=method, chat=False)
        s = r.stats
        assert 0.0 <= s.policy_s < s.total_s
        assert (s.policy_s > 0) == (method != "autoregressive"), (method, s.policy_s)
        runs.append(dict(s.to_dict(), set="s"))
    table = markdown_table(summarize(runs), ["eagle3", "heterospec", "autoregressive"])
    assert "| policy ms/call (fits) | other ms/call | prefill ms/prompt | lookup calls (history, corpus) |" in table
    assert "nan" not in table and all(line.count("|") == table.splitlines()[0].count("|") for line in table.splitlines())


def test_e2e_reports_the_policys_fit_time():
    """run_e2e records each run's seconds of plan fitting (``fit_s``, part of ``policy_s``); the
    summary reports them per target call beside the policy's time."""
    import types

    from heterospec.bench import _fit_seconds, markdown_table, summarize

    engine = types.SimpleNamespace(_fitted={"a": types.SimpleNamespace(_fit_s=0.25), "b": types.SimpleNamespace(_fit_s=0.5)})
    assert _fit_seconds(engine) == 0.75 and _fit_seconds(types.SimpleNamespace()) == 0.0
    run = dict(set="s", method="heterospec", new_tokens=10, total_s=1.0, prefill_s=0.1, rounds=4, target_calls=4,
               verified_tokens=12, records=[], draft_s=0.2, verify_s=0.4, policy_s=0.02, fit_s=0.008)
    m = summarize([run])["s"]["heterospec"]
    assert m["fit_ms_per_call"] == pytest.approx(2.0) and m["policy_ms_per_call"] == pytest.approx(5.0)
    assert "| 5.00 (2.00) |" in markdown_table(summarize([run]), ["heterospec"])


def test_greedy_mismatches_are_classified():
    """bench says whether each divergence from autoregressive is a rounding tie of the dtype:
    the top-2 gap at the divergence point, in ulps of the top logit."""
    from heterospec import Engine
    from heterospec.bench import TIE_ULPS, first_divergence, mismatch_summary

    hf = tiny_hf_llama(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, dtype=torch.float32, seed=3)
    engine = Engine(hf)
    prompt = [5, 6, 7]
    ref = engine.generate(prompt, max_new_tokens=6, method="autoregressive").token_ids
    out = ref[:3] + [(ref[3] + 1) % 64] + ref[4:]
    d = first_divergence(engine, prompt, ref, out)
    with torch.no_grad():
        top = hf(torch.tensor([prompt + ref[:3]])).logits[0, -1].float().topk(2).values
    assert d["diverge_at"] == 3 and d["top2_margin"] == pytest.approx(float(top[0] - top[1]), abs=1e-4)
    ulp = torch.finfo(torch.float32).eps * 2.0 ** math.floor(math.log2(abs(float(top[0]))))
    assert d["margin_ulps"] == pytest.approx(d["top2_margin"] / ulp, rel=1e-3)
    tie = {"margin_ulps": TIE_ULPS / 2}
    far = {"margin_ulps": 40 * TIE_ULPS}
    assert mismatch_summary([], "torch.bfloat16") == "0"
    assert "every one at a rounding tie" in mismatch_summary([tie, tie], "torch.bfloat16")
    assert "1 NOT at a rounding tie" in mismatch_summary([tie, far], "torch.bfloat16")
    assert "NOT at a rounding tie" in mismatch_summary([tie], "torch.float32")   # float32 never excuses


# --------------------------------------------------------------------------- argument validation
# Everything below runs without loading any model: `no_load` makes loading a test failure.

@pytest.fixture
def no_load(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("a model was loaded; the argument should have been rejected first")
    monkeypatch.setattr(heterospec.engine.Engine, "from_pretrained", classmethod(fail))
    monkeypatch.delenv("HETEROSPEC_DEBUG", raising=False)


@pytest.fixture
def fake_dir(tmp_path):
    """Passes the --target/--draft check (a directory with config.json); never loaded."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


def _usage_error(argv, capsys, prog):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"heterospec {prog}: error: "), err
    return line


@pytest.mark.parametrize("argv, msg", [
    (["bench", "--sets", "nosuchset"], "argument --sets: unknown prompt set 'nosuchset'; choose from mtbench"),
    (["bench", "--sets", "mtbench", "--n", "0"], "argument --n: must be an integer >= 1, got 0"),
    (["bench", "--n", "-1"], "argument --n: must be an integer >= 1, got -1"),
    (["bench", "--n", "two"], "argument --n: expected an integer >= 1, got 'two'"),
    (["bench", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1"),
    (["bench", "--max-new-tokens", "-3"], "argument --max-new-tokens: must be an integer >= 1"),
    (["bench", "--seed", "-1"], "argument --seed: must be an integer in [0, 2**63-1]"),
    (["calibrate", "--n", "-1"], "argument --n: must be an integer >= 1, got -1"),
    (["calibrate", "--n", "0"], "argument --n: must be an integer >= 1"),
    (["calibrate", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1"),
    (["calibrate", "--held-out", "-2"], "argument --held-out:"),
    (["calibrate", "--held-out-only"], "argument --held-out-only: needs --held-out N"),
    (["calibrate", "--held-out", "3", "--label", "pstar_rank"], "argument --held-out: checks the fitted policy's"),
    (["calibrate", "--lookup-prior", "3"], "argument --lookup-prior: needs --prompts-file"),
    (["calibrate", "--lookup-prior", "3", "--held-out", "2"], "argument --lookup-prior: measures the lookup prior alone"),
    (["calibrate", "--lookup-prior", "3", "--chain"], "argument --lookup-prior: measures the lookup prior alone"),
    (["generate", "x", "--max-new-tokens", "-1"], "argument --max-new-tokens: must be an integer >= 1"),
    (["generate", "x", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
    (["generate", "x", "--temperature", "nan"], "argument --temperature: must be a finite number, got nan"),
    (["generate", "x", "--temperature", "inf"], "argument --temperature: must be a finite number, got inf"),
    (["generate", "x", "--top-p", "2"], "argument --top-p: must be in (0, 1], got 2"),
    (["generate", "x", "--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
    (["generate", "x", "--top-p", "nan"], "argument --top-p: must be a finite number, got nan"),
    (["generate", "x", "--top-k", "-1"], "argument --top-k: must be an integer >= 0"),
    (["generate", "x", "--seed", "99999999999999999999999"], "argument --seed: must be an integer in [0, 2**63-1]"),
    (["generate", "x", "--seed", str(2 ** 63)], "argument --seed: must be an integer in [0, 2**63-1]"),
    (["generate", "x", "--seed", "-5"], "argument --seed: must be an integer in [0, 2**63-1]"),
    (["generate", "x", "--device", "nosuch"], "argument --device: unknown device 'nosuch'"),
    (["generate", "x", "--device", "meta"], "argument --device: unsupported device 'meta'"),
    (["generate", "x", "--tree-top-k", "0"], "argument --tree-top-k: must be an integer >= 1"),
    (["generate", "x", "--tree-top-k", "100"], "invalid tree settings (--tree-top-k/--depth/--total-tokens/--alpha)"),
    (["generate", "x", "--depth", "-1"], "argument --depth: must be an integer >= 0"),
    (["generate", "x", "--total-tokens", "0"], "argument --total-tokens: must be an integer >= 1"),
    (["generate", "x", "--alpha", "-1"], "argument --alpha: must be an integer >= 0"),
    (["generate", "   "], "the prompt is empty"),
    (["generate", "x", "--target", "/nonexistent-heterospec-dir"], "argument --target: no such directory"),
    (["verify-curve", "--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
    (["verify-curve", "--sizes", "0"], "argument --sizes: must be an integer >= 1, got 0"),
    (["verify-curve", "--sizes", "2", "0", "4"], "argument --sizes: must be an integer >= 1, got 0"),
    (["verify-curve", "--context", "0"], "argument --context: must be an integer >= 1"),
])
def test_bad_values_rejected_before_loading(argv, msg, no_load, capsys):
    assert msg in _usage_error(argv, capsys, argv[0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda(no_load, capsys):
    for dev in ("cuda", "cuda:0"):
        line = _usage_error(["generate", "x", "--device", dev], capsys, "generate")
        assert f"argument --device: '{dev}' requested but" in line and "--device cpu" in line


def test_pair_arguments_rejected_before_loading(no_load, fake_dir, capsys):
    line = _usage_error(["generate", "x", "--draft", fake_dir], capsys, "generate")
    assert line.endswith("--draft needs --target (the built-in draft belongs to the built-in target)")
    line = _usage_error(["generate", "x", "--target", fake_dir], capsys, "generate")
    assert "heterospec needs a draft model: pass --draft DIR (with --target alone use --method autoregressive)" in line
    line = _usage_error(["bench", "--target", fake_dir, "--methods", "eagle3", "heterospec"], capsys, "bench")
    assert "eagle3 and heterospec need a draft model" in line and "--methods autoregressive" in line
    line = _usage_error(["calibrate", "--target", fake_dir], capsys, "calibrate")
    assert "pass --draft DIR" in line
    empty = os.path.join(os.path.dirname(fake_dir), "empty")
    os.mkdir(empty)
    line = _usage_error(["generate", "x", "--target", empty], capsys, "generate")
    assert "argument --target:" in line and "has no config.json" in line
    line = _usage_error(["generate", "x", "--target", os.path.join(fake_dir, "config.json")], capsys, "generate")
    assert "argument --target: not a directory" in line


@pytest.mark.parametrize("cmd", ["bench", "verify-curve", "calibrate"])
def test_unusable_out_dir_rejected_before_loading(cmd, no_load, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    line = _usage_error([cmd, "--out", str(a_file / "x")], capsys, cmd)
    assert "argument --out: cannot create directory" in line and "Not a directory" in line
    line = _usage_error([cmd, "--out", str(a_file)], capsys, cmd)
    assert "argument --out:" in line and "exists and is not a directory" in line


def test_costs_out_names_a_file(no_load, tmp_path, capsys):
    """`costs --out` is the cost model file (not a directory to create): a directory is refused
    before loading, a file in a missing directory gets its directory."""
    line = _usage_error(["costs", "--out", str(tmp_path)], capsys, "costs")
    assert "argument --out:" in line and "is a directory; name the cost model file" in line
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    line = _usage_error(["costs", "--out", str(a_file / "cm.json")], capsys, "costs")
    assert "argument --out:" in line and "exists and is not a directory" in line


def test_out_dir_is_created_up_front(tmp_path, monkeypatch, capsys):
    """A usable --out is created before loading (so a bad one cannot fail after a long run)."""
    monkeypatch.delenv("HETEROSPEC_DEBUG", raising=False)

    def boom(*a, **k):
        raise RuntimeError("stop after validation")
    monkeypatch.setattr(heterospec.engine.Engine, "from_pretrained", classmethod(boom))
    out = tmp_path / "new" / "dir"
    assert main(["verify-curve", "--out", str(out)]) == 1
    assert out.is_dir() and os.listdir(out) == []
    assert capsys.readouterr().err == "heterospec: error: stop after validation\n"


@pytest.mark.parametrize("content, msg", [
    (None, "is a directory, not a prompts file"),
    ('{"nottext": 1}\n', 'line 1: JSON object has no "text" key'),
    ('plain prompt\n\n{bad json\n', "line 3: starts with '{' but is not valid JSON"),
    ('{"text": 5}\n', 'line 1: "text" must be a non-empty string, got 5'),
    ("\n  \n", "holds no prompts"),
    (b"\xff\xfe\x00bad", "is not UTF-8 text"),
])
def test_bad_prompts_file_rejected_before_loading(content, msg, no_load, tmp_path, capsys):
    path = tmp_path
    if content is not None:
        path = tmp_path / "prompts.txt"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = _usage_error(["calibrate", "--prompts-file", str(path), "--out", str(tmp_path)], capsys, "calibrate")
    assert "argument --prompts-file:" in line and msg in line


def test_missing_prompts_file(no_load, tmp_path, capsys):
    line = _usage_error(["calibrate", "--prompts-file", str(tmp_path / "nope.txt"), "--out", str(tmp_path)],
                        capsys, "calibrate")
    assert "cannot read" in line and "No such file or directory" in line


def test_calibrate_reads_prompts_file_and_honours_n(tmp_path, monkeypatch, capsys):
    from heterospec.entropy import EntropyBins

    seen = {}

    class FakeEngine:
        draft_dir = None

    def fake_calibrate_policy(engine, prompts, out_dir=None, **kw):
        from heterospec.policy import AcceptanceTables, BinningOption
        seen.update(prompts=list(prompts), out_dir=out_dir, **kw)
        tables = AcceptanceTables(2, [0], [1], [BinningOption(0, 2, "accept", [], [1], [[[0.0]]])],
                                  {"options": [{"decide_depth": 0}]})
        bins = EntropyBins([0.5, 1.0])
        tables.save(str(tmp_path / "o" / "acceptance_tables.json"))
        bins.save(str(tmp_path / "o" / "entropy_bins.json"))
        return tables, bins
    monkeypatch.setattr(heterospec.engine.Engine, "from_pretrained", classmethod(lambda cls, *a, **k: FakeEngine()))
    monkeypatch.setattr(importlib.import_module("heterospec.calibrate"), "calibrate_policy", fake_calibrate_policy)
    pf = tmp_path / "p.jsonl"
    pf.write_text('first prompt\n\n{"text": "second prompt", "id": 7}\n third\n')
    (tmp_path / "o").mkdir()
    assert main(["calibrate", "--prompts-file", str(pf), "--n", "2", "--max-new-tokens", "3",
                 "--out", str(tmp_path / "o")]) == 0
    assert seen["prompts"] == ["first prompt", "second prompt"] and seen["max_new_tokens"] == 3
    assert seen["source"] == str(pf) and seen["out_dir"] == str(tmp_path / "o")
    assert "acceptance_tables.json" in capsys.readouterr().out


def test_calibrate_held_out_checks_the_tables_and_saves_the_check(tmp_path, monkeypatch, capsys):
    """--held-out N --held-out-only: the tables already in --out are checked on the prompts-file's
    first N lines and the check is saved into them; with --n, a calibration then the next N lines;
    without tables, one line says so; a prompts-file too short is a usage error."""
    from heterospec.policy import AcceptanceTables, BinningOption

    seen = []

    class FakeEngine:
        draft_dir = None
        config = heterospec.SpecConfig(top_k=2, depth=1, total_tokens=3)

    def fake_measure(engine, tables, prompts, max_new_tokens=128, source="", **kw):
        seen.append(list(prompts))
        return {"position_scale": [0.8, 0.7], "predicted": [50.0, 20.0], "prompt_source": source,
                "prompts": len(prompts), "max_new_tokens": max_new_tokens}

    def tables():
        return AcceptanceTables(2, [0], [1], [BinningOption(0, 2, "accept", [], [1], [[[0.0]]])],
                                {"options": [{"decide_depth": 0}]})

    def fake_calibrate_policy(engine, prompts, out_dir=None, **kw):
        t = tables()
        t.path = os.path.join(out_dir, "acceptance_tables.json")
        t.save(t.path)
        return t, None
    monkeypatch.setattr(heterospec.engine.Engine, "from_pretrained", classmethod(lambda cls, *a, **k: FakeEngine()))
    monkeypatch.setattr(importlib.import_module("heterospec.calibrate"), "measure_held_out", fake_measure)
    monkeypatch.setattr(importlib.import_module("heterospec.calibrate"), "calibrate_policy", fake_calibrate_policy)
    out = tmp_path / "o"
    out.mkdir()
    pf = tmp_path / "p.txt"
    pf.write_text("a\nb\nc\nd\n")
    assert main(["calibrate", "--held-out", "2", "--held-out-only", "--prompts-file", str(pf), "--out", str(out)]) == 1
    assert "no acceptance tables for tree top_k 2" in capsys.readouterr().err
    tables().save(str(out / "acceptance_tables.json"))
    assert main(["calibrate", "--held-out", "2", "--held-out-only", "--prompts-file", str(pf), "--out", str(out)]) == 0
    saved = AcceptanceTables.load(str(out / "acceptance_tables.json")).held_out
    assert seen[-1] == ["a", "b"] and saved["position_scale"] == [0.8, 0.7] and saved["prompts"] == 2
    assert "held-out check" in capsys.readouterr().out
    (out / "acceptance_tables.json").unlink()
    assert main(["calibrate", "--n", "2", "--held-out", "2", "--prompts-file", str(pf), "--out", str(out)]) == 0
    assert seen[-1] == ["c", "d"] and AcceptanceTables.load(str(out / "acceptance_tables.json")).held_out["prompts"] == 2
    line = _usage_error(["calibrate", "--n", "3", "--held-out", "2", "--prompts-file", str(pf), "--out", str(out)],
                        capsys, "calibrate")
    assert "--prompts-file has 4 prompts; the held-out check takes 2 after the 3 calibration prompts" in line


def test_calibrate_held_out_of_chain_tables(tmp_path, monkeypatch, capsys):
    """--chain --held-out N --held-out-only: the chain tables (top_k 1, the engine drafting chains)
    are checked and the check lands in acceptance_tables_chain.json, not in the tree tables."""
    from heterospec.policy import CHAIN_TABLES_FILENAME, AcceptanceTables, BinningOption

    class FakeEngine:
        draft_dir = None

        def __init__(self, config):
            self.config = config

    seen = {}

    def fake_measure(engine, tables, prompts, max_new_tokens=128, source="", **kw):
        seen.update(top_k=engine.config.top_k, tables_top_k=tables.top_k, prompts=list(prompts))
        return {"position_scale": [0.9], "predicted": [30.0], "prompts": len(prompts)}
    monkeypatch.setattr(heterospec.engine.Engine, "from_pretrained",
                        classmethod(lambda cls, *a, **k: FakeEngine(k["config"])))
    monkeypatch.setattr(importlib.import_module("heterospec.calibrate"), "measure_held_out", fake_measure)
    out = tmp_path / "o"
    out.mkdir()
    pf = tmp_path / "p.txt"
    pf.write_text("x\ny\n")
    chain = AcceptanceTables(1, [0], [1], [BinningOption(0, 4, "accept", [], [1], [[[0.0]]])], {})
    chain.save(str(out / CHAIN_TABLES_FILENAME))
    assert main(["calibrate", "--chain", "--held-out", "2", "--held-out-only", "--prompts-file", str(pf),
                 "--out", str(out)]) == 0
    assert seen == {"top_k": 1, "tables_top_k": 1, "prompts": ["x", "y"]}
    assert AcceptanceTables.load(str(out / CHAIN_TABLES_FILENAME)).held_out["position_scale"] == [0.9]
    assert not (out / "acceptance_tables.json").exists()


@pytest.mark.parametrize("exc", [KeyError("/m: missing weights ['fc.weight']"), RuntimeError("r"), OSError("o"),
                                 FileNotFoundError("f"), ValueError("two\nlines")])
def test_errors_while_running_are_one_line(exc, monkeypatch, capsys):
    def boom(*a, **k):
        raise exc
    monkeypatch.setattr(heterospec.engine.Engine, "from_pretrained", classmethod(boom))
    monkeypatch.delenv("HETEROSPEC_DEBUG", raising=False)
    assert main(["generate", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("heterospec: error: ") and "Traceback" not in err
    if isinstance(exc, KeyError):
        assert err == "heterospec: error: /m: missing weights ['fc.weight']\n"   # no KeyError quotes
    if isinstance(exc, ValueError):
        assert err == "heterospec: error: two; lines\n"
    # HETEROSPEC_DEBUG=1: the exception itself, for a full traceback
    monkeypatch.setenv("HETEROSPEC_DEBUG", "1")
    with pytest.raises(type(exc)):
        main(["generate", "x"])


def test_bench_reports_missing_data_before_loading(no_load, tmp_path, monkeypatch, capsys):
    import heterospec.datasets as ds

    def missing(name, **kw):
        raise ds.MissingDataError(f"{name}: not installed; run pip install something")
    monkeypatch.setattr(ds, "load_prompts", missing)
    assert main(["bench", "--sets", "mtbench", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == "heterospec: error: mtbench: not installed; run pip install something\n"


def test_help_documents_debug_variable(capsys):
    for argv in (["--help"], ["generate", "--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0 and "HETEROSPEC_DEBUG=1" in capsys.readouterr().out


def test_train_draft_help_and_unknown_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train-draft", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert out.startswith("usage: heterospec train-draft")
    for step in ("distill", "pack", "vocab", "train", "simulate", "export"):
        assert step in out
    with pytest.raises(SystemExit) as e:
        main(["train-draft", "distill", "--help"])
    assert e.value.code == 0 and "--num-prompts" in capsys.readouterr().out
    for argv, msg in ((["train-draft", "--bogus"], "unrecognized arguments: --bogus"),
                      (["train-draft", "distill", "--bogus"], "unrecognized arguments: --bogus"),
                      (["train-draft"], "a step is required"),
                      (["train-draft", "nosuch"], "invalid choice: 'nosuch'")):
        assert msg in _usage_error(argv, capsys, "train-draft")
    # a step's own argument errors name the step
    assert "the following arguments are required: --out" in _usage_error(
        ["train-draft", "pack"], capsys, "train-draft pack")
    assert "invalid choice: 'fp8'" in _usage_error(
        ["train-draft", "train", "--amp", "fp8"], capsys, "train-draft train")


def test_bench_api_validates_arguments():
    import types

    from heterospec.bench import run_e2e, verify_latency_curve

    eng = types.SimpleNamespace(max_length=64)      # never used: every call fails its checks first
    for kw, msg in (({"n": 0}, "n must be an integer >= 1"), ({"n": -1}, "n must be an integer >= 1"),
                    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
                    ({"methods": ["nosuch"]}, "unknown methods"), ({"sets": []}, "at least one"),
                    ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
                    ({"temperature": 1.0, "top_p": 0.0}, "top_p must be in")):
        args = {"sets": ["mtbench"], "n": 1, "max_new_tokens": 1, **kw}
        with pytest.raises(ValueError, match=msg):
            run_e2e(eng, out_dir=None, progress=False, **args)
    for kw, msg in (({"sizes": [2, 0]}, "sizes must be integers >= 1"), ({"sizes": []}, "sizes must be"),
                    ({"repeats": 0}, "repeats must be an integer >= 1"), ({"context": 0}, "context must be"),
                    ({"context": 60, "sizes": [8]}, "exceeds the target's max length 64")):
        with pytest.raises(ValueError, match=msg):
            verify_latency_curve(eng, out_dir=None, **{"sizes": [1], "context": 8, "repeats": 1, **kw})


@pytest.mark.parametrize("argv,msg", [
    (["distill", "--num-prompts", "-1"], "argument --num-prompts: must be an integer >= 1"),
    (["distill", "--sampled-fraction", "1.5"], r"argument --sampled-fraction: must be in \[0, 1\]"),
    (["distill", "--temperature", "0"], "argument --temperature: must be a finite number > 0"),
    (["train", "--steps", "0"], "argument --steps: must be an integer >= 1"),
    (["train", "--lr", "nan"], "argument --lr: must be a finite number"),
    (["train", "--warmup", "-3"], "argument --warmup: must be an integer >= 0"),
    (["simulate", "--nodes", "0"], "argument --nodes: must be an integer >= 1"),
    (["vocab", "--size", "x"], "argument --size: expected an integer"),
    (["selfchat", "--num-samples", "0"], "argument --num-samples: must be an integer >= 1"),
    (["selfchat", "--top-p", "1.5"], r"argument --top-p: must be in \[0, 1\]"),
    (["train", "--min-lr-ratio", "2"], r"argument --min-lr-ratio: must be in \[0, 1\]"),
    (["distill", "--mix", "selfchat=-1"], "expected SOURCE=WEIGHT"),
])
def test_train_draft_numbers_are_checked_when_parsed(argv, msg, capsys):
    from heterospec.train.cli import main as train_main

    with pytest.raises(SystemExit) as e:
        train_main(argv)
    assert e.value.code == 2
    assert re.search(msg, capsys.readouterr().err)


def test_batch_sweep_repeats_report_paired_medians(monkeypatch):
    """With repeats, a row's tokens/s is the median of its calls and its ratio the median of the
    per-repeat ratios to the autoregressive call of the same repeat (a slow moment of the machine
    slows both calls of a repeat: pairing cancels it)."""
    import types

    import heterospec.bench as bench

    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    # seconds per call, per (method, repeat): repeat 1 is a slow moment of the machine for both
    secs = {("autoregressive", 0): 1.0, ("eagle3", 0): 0.8, ("autoregressive", 1): 3.0, ("eagle3", 1): 2.0,
            ("autoregressive", 2): 1.0, ("eagle3", 2): 1.25}
    seen = []

    warm = []

    def generate_batch(prompts, max_new_tokens, method, policy=None):
        if max_new_tokens == 8 or sum(w is not None for w in warm) < 2:   # warm-ups: short, then each method at full length
            warm.append((method, max_new_tokens, len(prompts)) if max_new_tokens != 8 else None)
            return []
        rep = sum(1 for m in seen if m == method)
        seen.append(method)
        clock[0] += secs[(method, rep)] * len(prompts)
        rec = types.SimpleNamespace(accept_len=1 if method == "eagle3" else 0, plain=False, lookup=False)
        return [types.SimpleNamespace(token_ids=[1] * 10, stats=types.SimpleNamespace(records=[rec]))
                for _ in prompts]

    eng = types.SimpleNamespace(generate_batch=generate_batch, device=torch.device("cpu"),
                                target=types.SimpleNamespace(lm_head=types.SimpleNamespace(
                                    weight=torch.zeros(1))))
    out = bench.batch_sweep(eng, ["a", "b"], batch_sizes=[2], methods=["autoregressive", "eagle3"],
                            max_new_tokens=10, out_dir=None, progress=False, repeats=3)
    assert len(out["calls"]) == 6 and out["repeats"] == 3
    # warmed up at the largest batch size and the timed length, every method once
    assert sorted(w for w in warm if w is not None) == [("autoregressive", 10, 2), ("eagle3", 10, 2)]
    row = {r["method"]: r for r in out["rows"]}
    # eagle3 per repeat: 1.25x, 1.5x, 0.8x the autoregressive call -> median 1.25x
    assert row["eagle3"]["vs_autoregressive"] == pytest.approx(1.25)
    assert row["eagle3"]["tokens_per_s"] == pytest.approx(20 / 2.5)      # median of 20/1.6, 20/4, 20/2.5
    assert row["autoregressive"]["vs_autoregressive"] == pytest.approx(1.0)
    assert out["greedy_mismatches"] == 0 and out["greedy_divergences"] == []
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        bench.batch_sweep(eng, ["a", "b"], batch_sizes=[2], methods=["autoregressive"], out_dir=None,
                          progress=False, repeats=0)


def test_batch_sweep_runs_the_same_prompts_at_every_batch_size(monkeypatch, tmp_path):
    """With prompts_per_size W every batch size B decodes the first W prompts in W/B calls of B,
    the methods taking turns call by call; a row's tokens/s is its calls' tokens over their
    summed time, and a size that does not divide W, or too few prompts, is refused by name."""
    import types

    import heterospec.bench as bench

    clock, seen = [0.0], []
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    warm = []

    def generate_batch(prompts, max_new_tokens, method, policy=None):
        if max_new_tokens == 8 or sum(w is not None for w in warm) < 2:   # warm-ups: short, then each method at full length
            warm.append(len(prompts) if max_new_tokens != 8 else None)
            return []
        seen.append((method, tuple(prompts)))
        # eagle3 takes 0.5 s per call whatever its size, autoregressive 0.25 s per prompt
        clock[0] += 0.5 if method == "eagle3" else 0.25 * len(prompts)
        rec = types.SimpleNamespace(accept_len=0, plain=True, lookup=False)
        return [types.SimpleNamespace(token_ids=[1] * 10, stats=types.SimpleNamespace(records=[rec]))
                for _ in prompts]

    eng = types.SimpleNamespace(generate_batch=generate_batch, device=torch.device("cpu"),
                                target=types.SimpleNamespace(lm_head=types.SimpleNamespace(
                                    weight=torch.zeros(1))))
    prompts = ["a", "b", "c", "d", "e"]
    out = bench.batch_sweep(eng, prompts, batch_sizes=[1, 2, 4], methods=["autoregressive", "eagle3"],
                            max_new_tokens=10, out_dir=str(tmp_path), progress=False, prompts_per_size=4)
    assert out["prompts_per_size"] == 4
    # the table gives the interval where there is one; the plot has the ratios' panel
    table = (tmp_path / "batch_sweep.md").read_text()
    assert "| 1 | 20.0 (0.50x; 0.50-0.50) | 40.0 (1.00x) |" in table and "| 2 | 40.0 (1.00x) | 40.0 (1.00x) |" in table
    assert "90% bootstrap interval" in table and (tmp_path / "batch_sweep.png").stat().st_size > 0
    assert [w for w in warm if w is not None] == [4, 4]     # each method warmed up at the largest batch size
    assert [p for m, p in seen if m == "eagle3"] == [("a",), ("b",), ("c",), ("d",), ("a", "b"), ("c", "d"),
                                                    ("a", "b", "c", "d")]
    first = [m for m, p in seen][:4]       # call by call, the methods take turns going first
    assert set(first[:2]) == {"autoregressive", "eagle3"} and first[2:] == first[1::-1]
    rows = {(r["method"], r["batch_size"]): r for r in out["rows"]}
    for B, calls in ((1, 4), (2, 2), (4, 1)):
        assert rows[("eagle3", B)]["tokens"] == 40 and rows[("autoregressive", B)]["tokens"] == 40
        assert rows[("eagle3", B)]["tokens_per_s"] == pytest.approx(40 / (0.5 * calls))
        assert rows[("autoregressive", B)]["tokens_per_s"] == pytest.approx(40 / 1.0)
        assert rows[("eagle3", B)]["vs_autoregressive"] == pytest.approx(2.0 / calls)
    # every call group is kept, each method's tokens and seconds on the same prompts
    assert [(u["batch_size"], u["group"]) for u in out["call_groups"]] == [(1, 0), (1, 1), (1, 2), (1, 3),
                                                                         (2, 0), (2, 1), (4, 0)]
    assert out["call_groups"][0]["wall_s"] == {"autoregressive": 0.25, "eagle3": 0.5}
    # batch 1 has four paired groups, each at 0.5x: an interval of one point; fewer groups: none
    assert rows[("eagle3", 1)]["vs_autoregressive_interval"] == pytest.approx([0.5, 0.5])
    assert rows[("eagle3", 2)]["vs_autoregressive_interval"] is None
    assert rows[("autoregressive", 1)]["vs_autoregressive_interval"] is None
    with pytest.raises(ValueError, match=r"prompts_per_size=6 is not a multiple of batch size\(s\) \[4\]"):
        bench.batch_sweep(eng, prompts * 2, batch_sizes=[1, 2, 4], methods=["autoregressive"], out_dir=None,
                          progress=False, prompts_per_size=6)
    with pytest.raises(ValueError, match="5 prompts for prompts_per_size=8"):
        bench.batch_sweep(eng, prompts, batch_sizes=[1, 2], methods=["autoregressive"], out_dir=None,
                          progress=False, prompts_per_size=8)
    with pytest.raises(ValueError, match="prompts_per_size must be an integer >= 1"):
        bench.batch_sweep(eng, prompts, batch_sizes=[1], methods=["autoregressive"], out_dir=None,
                          progress=False, prompts_per_size=0)


def test_paired_ratio_interval_resamples_paired_call_groups():
    """The interval of a method's rate over autoregressive's is drawn from whole call groups: a
    slow moment that slows both methods of a group leaves the ratio alone, a method that is
    sometimes faster and sometimes slower gets an interval across 1, and it is seeded."""
    from heterospec.bench import RATIO_MIN_GROUPS, paired_ratio_interval

    def unit(t_ar, t_hs, tokens=100):
        return {"tokens": {"autoregressive": tokens, "heterospec": tokens},
                "wall_s": {"autoregressive": t_ar, "heterospec": t_hs}}

    # always 10 % faster, at very different speeds of the machine
    steady = [unit(1.1 * s, s) for s in (1.0, 3.0, 0.5, 2.0, 1.5)]
    assert paired_ratio_interval(steady, "heterospec") == pytest.approx([1.1, 1.1])
    # faster in some groups, slower in others: the pooled ratio lies inside, and so does 1
    mixed = [unit(1.0, 0.9), unit(1.0, 1.1), unit(1.0, 0.95), unit(1.0, 1.08), unit(1.0, 1.0), unit(1.0, 0.97)]
    lo, hi = paired_ratio_interval(mixed, "heterospec")
    pooled = 6.0 / sum(u["wall_s"]["heterospec"] for u in mixed)
    assert lo < pooled < hi and lo < 1.0 < hi and hi - lo < 0.2
    assert paired_ratio_interval(mixed, "heterospec") == [lo, hi]            # seeded
    assert paired_ratio_interval(mixed, "heterospec", level=0.5)[1] - paired_ratio_interval(
        mixed, "heterospec", level=0.5)[0] < hi - lo                        # a lower level: narrower
    # too few groups, a method a group lacks, or the reference itself: no interval
    assert paired_ratio_interval(mixed[:RATIO_MIN_GROUPS - 1], "heterospec") is None
    assert paired_ratio_interval(mixed, "eagle3") is None
    assert paired_ratio_interval(mixed, "autoregressive") is None


def test_batch_sweep_says_where_greedy_outputs_part_and_whether_at_a_tie(monkeypatch, capsys):
    """A sweep whose second request parts from autoregressive under one method: counted once per
    differing output, located (prompt, batch size, method) and classified as the bench does."""
    import types

    from heterospec import bench

    def generate_batch(prompts, max_new_tokens, method, **kw):
        rec = types.SimpleNamespace(accept_len=0, plain=True, lookup=False)
        toks = [[1, 2, 3], [1, 2, 3]] if method == "autoregressive" else [[1, 2, 3], [1, 9, 3]]
        return [types.SimpleNamespace(token_ids=t, stats=types.SimpleNamespace(records=[rec])) for t in toks[:len(prompts)]]

    seen = []

    def first_divergence(engine, prompt_ids, ref, out):
        seen.append((prompt_ids, ref, out))
        return {"diverge_at": 1, "top2_margin": 0.01, "margin_ulps": 2.0}

    monkeypatch.setattr(bench, "first_divergence", first_divergence)
    eng = types.SimpleNamespace(generate_batch=generate_batch, device=torch.device("cpu"),
                                _encode=lambda p, chat: [ord(c) for c in p],
                                target=types.SimpleNamespace(lm_head=types.SimpleNamespace(
                                    weight=torch.zeros(1, dtype=torch.bfloat16))))
    out = bench.batch_sweep(eng, ["a", "b"], batch_sizes=[1, 2], methods=["autoregressive", "eagle3"],
                            max_new_tokens=3, out_dir=None, progress=False, repeats=2)
    assert out["greedy_mismatches"] == 2 and seen == [([ord("b")], [1, 2, 3], [1, 9, 3])] * 2
    assert [(d["repeat"], d["batch_size"], d["prompt"], d["method"]) for d in out["greedy_divergences"]] == \
        [(0, 2, 1, "eagle3"), (1, 2, 1, "eagle3")]
    assert "2, every one at a rounding tie of torch.bfloat16" in capsys.readouterr().out


def test_costs_in_use_only_needs_a_saved_model(monkeypatch, tmp_path, capsys):
    """`costs --in-use only` times the engine's rounds against this device's saved model: with
    none it says so and exits 2 (nothing written), instead of measuring a model unasked."""
    import heterospec.cli as cli
    from heterospec import costmodel
    monkeypatch.setattr(cli, "_engine", lambda args: object())
    monkeypatch.setattr(costmodel, "load_for", lambda engine, path=None: None)
    out = tmp_path / "cm.json"
    assert cli.main(["costs", "--in-use", "only", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"no cost model for this device at {out}" in err and "measure one first" in err
    assert not out.exists()
    assert cli.build_parser().parse_args(["costs"]).in_use == "skip"
