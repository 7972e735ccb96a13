"""The `heterospec` command line on a tiny pair saved to disk (with the SmolLM2 tokenizer)."""

import json
import math
import os
import shutil

import pytest
import torch

import heterospec
from heterospec.cli import main
from tests.engine_util import tiny_hf_llama


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    from heterospec.defaults import default_target_dir
    try:
        smol = default_target_dir()
    except Exception as e:
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
    with pytest.raises(SystemExit, match="--draft needs --target"):
        main(["generate", "x", "--draft", d])
    assert main(["generate", "x", "--target", t, "--draft", d, "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "x", "--target", str(t) + "-missing"]) == 2


def test_from_pretrained_draft_dtype(pair_dirs):
    t, d = pair_dirs
    eng = heterospec.Engine.from_pretrained(t, d, draft_dtype=torch.bfloat16)
    assert eng.draft.dtype == torch.bfloat16 and eng.target.lm_head.weight.dtype == torch.float32
    eng = heterospec.Engine.from_pretrained(t, d, draft_dtype=torch.float32)
    assert eng.draft.dtype == torch.float32
    ref = eng.generate("Say hi.", max_new_tokens=6, method="autoregressive").token_ids
    assert eng.generate("Say hi.", max_new_tokens=6, method="eagle3").token_ids == ref


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
