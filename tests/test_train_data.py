"""Issue-11 data pipeline pieces: disjointness check, chat prompt source, TTT default,
training_info data fields. Fast; no network, no benchmark packages needed."""

from __future__ import annotations

import json
import random

import pytest

from heterospec.train import deepest_draft_layers, default_ttt_steps
from heterospec.train import disjoint as DJ
from heterospec.train import prompts as TP
from heterospec.train.prompts import Prompt


def _p(i, text):
    return Prompt(id=f"t/{i}", text=text, source="test")


BENCH = {
    "mtbench": ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
                "cultural experiences and must-see attractions."],
    "humaneval": ["def has_close_elements(numbers, threshold):\n    \"\"\" Check if in given list of "
                  "numbers, are any two numbers closer to each other than given threshold.\"\"\""],
    "gsm": ["Maria bakes 24 cookies and gives 5 to each of her 3 friends. How many cookies does "
            "Maria have left after that?"],
    "alpaca": ["Who are you?"],
    "cnndm": ["Summarize the following text:\n\nThe garbage collector module provides an interface "
              "to the optional garbage collector, with the ability to disable it and tune it."],
    "calibration": ["Write a persuasive essay about urban gardening for a busy manager, with three "
                    "clear arguments and a short conclusion."],
}


def _index():
    idx = DJ.OverlapIndex()
    for name, texts in BENCH.items():
        idx.add(name, texts)
    return idx


def test_normalise_and_ngrams():
    assert DJ.normalise("  Who ARE you?!  ") == "who are you"
    assert DJ.normalise("ﬁle—name") == "file name"       # NFKC ligature, dash -> space
    assert DJ.ngrams("a b c", 8) == set()
    assert len(DJ.ngrams(" ".join("abcdefghij"), 8)) == 3


def test_overlapping_prompts_are_dropped_and_reported():
    idx = _index()
    clean = [_p(0, "Write a haiku about the ocean tides."),
             _p(1, "Explain photosynthesis to a high school student in two paragraphs, please."),
             _p(2, "Who are you today, and what is your favourite colour?")]
    dupes = [
        # exact duplicate modulo case / punctuation / whitespace (alpaca, short: exact only)
        _p(10, "who are you"),
        # near duplicate of the mtbench prompt: one word changed
        _p(11, "Compose an engaging travel blog post about a recent trip to Japan, highlighting "
               "cultural experiences and must-see attractions."),
        # a training prompt that *contains* a benchmark prompt (humaneval) inside a longer task
        _p(12, "Explain this code, then complete it:\n\ndef has_close_elements(numbers, threshold):\n"
               "    \"\"\" Check if in given list of numbers, are any two numbers closer to each "
               "other than given threshold.\"\"\"\n\nUse a double loop and add tests and comments."),
        # the gsm problem with other formatting
        _p(13, "MARIA bakes 24 cookies, and gives 5 to each of her 3 friends -- how many cookies "
               "does Maria have left after that"),
        # the cnndm passage inside another summarisation template
        _p(14, "Give a one-paragraph summary of this text:\n\nThe garbage collector module provides "
               "an interface to the optional garbage collector, with the ability to disable it and "
               "tune it."),
        # the calibration prompt
        _p(15, "Write a persuasive essay about urban gardening for a busy manager, with three clear "
               "arguments and a short conclusion."),
    ]
    kept, rep = DJ.filter_prompts(clean + dupes, idx)
    assert [p.id for p in kept] == [p.id for p in clean]
    assert rep["dropped"] == len(dupes) and rep["candidates"] == len(clean) + len(dupes)
    assert rep["dropped_per_set"] == {"alpaca": 1, "calibration": 1, "cnndm": 1, "gsm": 1,
                                      "humaneval": 1, "mtbench": 1}
    assert rep["reference_sizes"]["mtbench"] == 1 and rep["examples"]["gsm"]
    json.dumps(rep)  # serialisable (goes into the manifest and training_info.json)


def test_shared_template_words_alone_do_not_drop():
    """A prompt sharing only template words (a few 8-grams of a long reference) is kept."""
    idx = DJ.OverlapIndex()
    ref = ("Write a Python function that returns the sum of the squares of a list of numbers. "
           "Include a docstring and two examples, and explain the time complexity in one sentence.")
    idx.add("calibration", [ref])
    cand = ("Write a Python function that returns the longest palindrome in a string of letters. "
            "Include a docstring and two examples, and explain the time complexity in one sentence.")
    kept, rep = DJ.filter_prompts([_p(0, cand)], idx)
    assert len(kept) == 1 and rep["dropped"] == 0


def test_ttt_default_covers_deepest_engine_draft():
    from heterospec.config import CPU_DEFAULT, OFFICIAL

    assert deepest_draft_layers() == OFFICIAL.depth + 1 + OFFICIAL.resolved_alpha
    assert deepest_draft_layers() >= CPU_DEFAULT.depth + 1 + CPU_DEFAULT.resolved_alpha
    assert default_ttt_steps() >= 7 and default_ttt_steps() == deepest_draft_layers()
    from heterospec.train.cli import build_parser

    args = build_parser().parse_args(["train"])
    assert args.ttt_steps == default_ttt_steps()
    torch = pytest.importorskip("torch")  # noqa: F841
    from heterospec.train.trainer import TrainConfig

    assert TrainConfig(data_dir="d", run_dir="r").ttt_steps == default_ttt_steps()


def test_chat_source_reads_corpus_and_reports_licence(tmp_path):
    eng = tmp_path / "english"
    eng.mkdir()
    (eng / "science.yml").write_text(
        "categories:\n- science\nconversations:\n"
        "- - What is the speed of light?\n  - About 300,000 km per second.\n"
        "  - How long does light take from the Sun to us?\n  - About eight minutes.\n"
        "- - what is the speed of light?\n  - Duplicate, dropped.\n"
        "- - Hi\n  - Too short, dropped.\n")
    turns = TP.chat_user_turns(eng)
    assert [t for _, _, t in turns] == ["What is the speed of light?",
                                        "How long does light take from the Sun to us?"]
    info = TP.source_info(TP.DISTILL_MIX)
    assert set(info) == set(TP.DISTILL_MIX)
    assert "BSD" in info["chat"]["licence"] and "PSF" in info["code"]["licence"]
    # without the package (fetching is off in tests) the source is skipped with a clear message
    from heterospec import fetch as FE

    if not FE.available("chatterbot_corpus"):
        with pytest.raises(TP.MissingDataError, match="heterospec fetch train"):
            TP.chat_corpus_dir()


def test_calibration_split_unchanged_by_distill_mix():
    """DISTILL_MIX must not leak into DEFAULT_MIX (calibration_prompts is drawn from it)."""
    assert TP.DEFAULT_MIX == {"instruct": 0.45, "code": 0.2, "docs": 0.15, "math": 0.2}
    assert "chat" in TP.DISTILL_MIX and TP.DISTILL_NUM_PROMPTS >= 12500
    from heterospec.train.cli import DISTILL_NUM_PROMPTS

    assert DISTILL_NUM_PROMPTS == TP.DISTILL_NUM_PROMPTS


def test_filter_real_training_prompts_against_synthetic_refs():
    """The filter keeps template-built training prompts apart from an unrelated reference set
    and drops exactly the ones planted from it."""
    train = TP.build_training_prompts(200, seed=3, mix={"instruct": 0.6, "math": 0.4})
    rng = random.Random(0)
    planted = rng.sample(train, 5)
    idx = DJ.OverlapIndex()
    idx.add("mtbench", [p.text for p in planted])
    kept, rep = DJ.filter_prompts(train, idx)
    assert rep["dropped_per_set"]["mtbench"] >= 5
    assert not {p.text for p in planted} & {p.text for p in kept}
    # near-duplicate template fills may go too, but not a large share of the set
    assert len(kept) >= len(train) - 25


def test_graph_warmup_prompts_are_no_benchmark_or_calibration_prompt():
    """run_e2e warms graph engines up on WARMUP_PROMPTS: none may be (a near duplicate of) a
    prompt it then times, nor of the calibration split."""
    from heterospec.bench import WARMUP_PROMPTS
    from heterospec.train.disjoint import reference_sets

    idx = reference_sets(log=lambda *_: None)
    assert len(WARMUP_PROMPTS) >= 3
    for text in WARMUP_PROMPTS:
        assert idx.overlaps(text) == set(), text


def test_a_missing_benchmark_set_is_read_from_the_reference_file(tmp_path, monkeypatch):
    """The offline GPU host lacks some sets' data: with $HETEROSPEC_DISJOINT_REFS (a file of
    `heterospec train-draft references`) they are checked against the file's texts, not skipped."""
    from heterospec import datasets as DS

    def texts(name, *a, **k):
        if name in ("gsm", "cnndm"):
            raise DS.MissingDataError(f"{name} is not here")
        return BENCH[name]

    path = tmp_path / "refs.json.gz"
    monkeypatch.setattr(DJ, "benchmark_texts", lambda name, *a, **k: BENCH[name])
    assert DJ.write_reference_file(path, sets=("gsm",)) == {"gsm": 1}
    monkeypatch.setattr(DJ, "benchmark_texts", texts)
    # without the file: a clear error, or (allow_missing) reported and not checked
    monkeypatch.delenv(DJ.REFERENCES_ENV, raising=False)
    with pytest.raises(DS.MissingDataError, match="gsm"):
        DJ.reference_sets(calibration=(), log=lambda *_: None)
    log = []
    idx = DJ.reference_sets(calibration=(), allow_missing=True, log=log.append)
    assert idx.sizes["gsm"] == 0 and any("gsm unavailable" in m for m in log)
    # with it: gsm is checked from the file; cnndm is not in the file, so it still needs allow_missing
    monkeypatch.setenv(DJ.REFERENCES_ENV, str(path))
    with pytest.raises(DS.MissingDataError, match="cnndm"):
        DJ.reference_sets(calibration=(), log=lambda *_: None)
    idx = DJ.reference_sets(calibration=(), allow_missing=True, log=lambda *_: None)
    assert idx.sizes["gsm"] == 1 and idx.sizes["cnndm"] == 0
    assert idx.overlaps(BENCH["gsm"][0].upper()) == {"gsm"}
    # a file of anything else is refused by name
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"not gzip")
    monkeypatch.setenv(DJ.REFERENCES_ENV, str(bad))
    with pytest.raises(ValueError, match="not a reference file"):
        DJ.reference_sets(calibration=(), allow_missing=True, log=lambda *_: None)
