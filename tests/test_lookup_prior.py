"""The lookup prior (heterospec.lookup.LOOKUP_PRIOR_FILE): what calibrate.measure_lookup_prior counts
against a brute-force replay, how a fresh gate starts from it (and forgets it), malformed files refused
with a clear error or warning, the engine and the vLLM plugin's lookup steps seeded from the file next to
the draft, the shipped prior, and calibrate --lookup-prior's wiring."""

import json
import os

import pytest

from heterospec.calibrate import measure_lookup_prior, save_lookup_prior
from heterospec.lookup import (CORPUS_ROW, HISTORY_ROW, LOOKUP_KMAX, LOOKUP_PRIOR_FILE, LOOKUP_PRIOR_FORMAT,
                               MATCH_BUCKETS, SOURCES, LookupGate, check_lookup_prior, load_lookup_prior,
                               match_bucket)
from tests.test_lookup import reference_history, reference_propose

ROWS = len(MATCH_BUCKETS) * len(SOURCES)


def _prior(tried0=100.0, rate=0.5, rows=ROWS, k=LOOKUP_KMAX, **extra):
    """A well-formed prior whose every row verified ``tried0`` first tokens, accepting ``rate`` of
    each position's (so position j verified tried0 * rate**j)."""
    tried = [[tried0 * rate ** j for j in range(k)] for _ in range(rows)]
    hit = [[t * rate for t in r] for r in tried]
    return {"format": LOOKUP_PRIOR_FORMAT, "kmax": k, "buckets": list(MATCH_BUCKETS), "sources": list(SOURCES),
            "tried": tried, "hit": hit, **extra}


class _Result:
    def __init__(self, ids):
        self.token_ids = ids


class _Corpus:
    """A stand-in lookup corpus: proposes the context's last token repeated, graded 3."""
    def __init__(self):
        self.asked = []

    def propose(self, context, k):
        self.asked.append(len(context))
        return [context[-1]] * k, 3


class _Engine:
    """What measure_lookup_prior uses of an engine: prompts as token ids, a scripted greedy output."""
    def __init__(self, outputs, corpus=None):
        self.outputs, self.lookup_corpus, self.calls = outputs, corpus, []

        class _Cfg:
            vocab_size = 9

        class _Target:
            config = _Cfg()
        self.target = _Target()

    def _encode(self, p, chat):
        return list(p)

    def generate(self, ids, max_new_tokens, method, chat):
        assert method == "autoregressive" and chat is False
        self.calls.append(tuple(ids))
        return _Result(self.outputs[tuple(ids)][:max_new_tokens])


def _replay(prompts, outputs, K, corpus):
    """The counts by brute force: at every step, each source's chain against what followed."""
    tried, hit = [[0] * K for _ in range(ROWS)], [[0] * K for _ in range(ROWS)]
    segments = []
    for p in prompts:
        out = outputs[tuple(p)]
        for t in range(len(out) - 1):
            ctx, ahead = list(p) + out[:t + 1], out[t + 1:]
            own, n = reference_propose(ctx, K, 8)
            props = [(own, match_bucket(n) if n else None),
                     ]
            hchain, hn = reference_history(segments, ctx, K, 8, skip=p)
            props.append((hchain, HISTORY_ROW + match_bucket(hn) if hn else None))
            if corpus and n < 3:
                props.append(([ctx[-1]] * K, CORPUS_ROW + 3 - 1))
            for chain, row in props:
                chain = chain[:len(ahead)]
                if not chain:
                    continue
                a = 0
                while a < len(chain) and chain[a] == ahead[a]:
                    a += 1
                for j in range(min(a + 1, len(chain))):
                    tried[row][j] += 1
                    hit[row][j] += j < a
        segments.append((list(p), list(p) + out))
    return tried, hit


@pytest.mark.parametrize("corpus", [False, True])
def test_measured_prior_counts_what_a_brute_force_replay_finds(corpus):
    import random
    rng = random.Random(3)
    prompts = [tuple(rng.randrange(4) for _ in range(rng.randrange(2, 9))) for _ in range(6)]
    outputs = {p: [rng.randrange(4) if rng.random() < 0.4 else (i % 3) for i in range(rng.randrange(5, 30))]
               for p in prompts}
    engine = _Engine(outputs, _Corpus() if corpus else None)
    prior = measure_lookup_prior(engine, prompts, max_new_tokens=64, source="test", progress=False)
    check_lookup_prior(prior)
    want_tried, want_hit = _replay(prompts, outputs, LOOKUP_KMAX, corpus)
    assert prior["tried"] == want_tried and prior["hit"] == want_hit
    assert engine.calls == [tuple(p) for p in prompts]
    assert prior["vocab_size"] == 9 and prior["prompts"] == 6 and prior["temperature"] == 0.0
    assert sum(prior["tried"][r][0] for r in range(HISTORY_ROW, CORPUS_ROW)) > 0       # earlier requests copied
    assert (sum(prior["tried"][r][0] for r in range(CORPUS_ROW, ROWS)) > 0) == corpus
    # a verified token at j + 1 needs the one at j accepted
    assert all(r[j + 1] <= h[j] for r, h in zip(prior["tried"], prior["hit"]) for j in range(LOOKUP_KMAX - 1))
    with pytest.raises(ValueError, match="no prompts"):
        measure_lookup_prior(engine, [], progress=False)


def test_a_fresh_gate_starts_from_the_prior_and_forgets_it():
    prior = _prior(tried0=400.0, rate=0.25)
    prior["tried"][3] = [4.0] * LOOKUP_KMAX          # too few first tokens measured: not seeded
    prior["hit"][3] = [4.0] * LOOKUP_KMAX
    gate = LookupGate()
    gate.seed(prior)
    w, f = LookupGate.PRIOR_WEIGHT, LookupGate.PRIOR_EVIDENCE / 400.0
    want0 = (100.0 * f + w * LookupGate.PRIOR) / (400.0 * f + w)
    assert gate.accept(0)[0] == pytest.approx(want0) and want0 < 0.35
    assert gate.accept(3) == [LookupGate.PRIOR] * LOOKUP_KMAX
    # a short chain's gate takes the prior's first positions
    short = LookupGate(kmax=3)
    short.seed(prior)
    assert short.accept(0) == pytest.approx(gate.accept(0)[:3])
    # rounds that propose and are not verified fade it back towards PRIOR: the row is retried
    for _ in range(300):
        gate._fade([0])
    assert gate.accept(0)[0] > 0.45
    # a saved state replaces the seed
    again = LookupGate()
    again.seed(prior)
    assert again.load_state(LookupGate().state())
    assert again.accept(0) == [LookupGate.PRIOR] * LOOKUP_KMAX


@pytest.mark.parametrize("change, msg", [
    (lambda p: p.update(format=0), "format 0, expected 1"),
    (lambda p: p.update(buckets=[1, 2]), "match buckets"),
    (lambda p: p.update(sources=["context"]), "sources"),
    (lambda p: p.pop("hit"), "'tried' and 'hit' must be lists"),
    (lambda p: p.update(tried=p["tried"][:3]), "rows of equal, non-zero lengths"),
    (lambda p: p["hit"][2].__setitem__(1, 1e9), "row 2, position 1: accepted"),
    (lambda p: p["tried"][1].__setitem__(0, float("nan")), "row 1, position 0"),
])
def test_malformed_priors_are_refused_with_what_is_wrong(change, msg, tmp_path):
    prior = _prior()
    change(prior)
    with pytest.raises(ValueError, match=msg):
        check_lookup_prior(prior)
    with pytest.raises(ValueError, match=msg):
        LookupGate().seed(prior)
    (tmp_path / LOOKUP_PRIOR_FILE).write_text(json.dumps(prior))
    with pytest.warns(UserWarning, match="is not used"):
        assert load_lookup_prior(str(tmp_path)) is None


def test_prior_files_load_where_they_fit(tmp_path):
    assert load_lookup_prior(None) is None and load_lookup_prior(str(tmp_path)) is None      # none there
    path = save_lookup_prior(_prior(vocab_size=9), str(tmp_path / "d"))
    assert os.path.basename(path) == LOOKUP_PRIOR_FILE
    assert load_lookup_prior(str(tmp_path / "d"), vocab_size=9)["vocab_size"] == 9
    with pytest.warns(UserWarning, match="vocabulary of 9 tokens, the target has 12"):
        assert load_lookup_prior(str(tmp_path / "d"), vocab_size=12) is None
    (tmp_path / "d" / LOOKUP_PRIOR_FILE).write_text("{not json")
    with pytest.warns(UserWarning, match="is not used"):
        assert load_lookup_prior(str(tmp_path / "d")) is None
    with pytest.raises(ValueError, match="format"):
        save_lookup_prior({"format": 7}, str(tmp_path / "e"))


def test_engine_and_vllm_lookup_steps_start_from_the_prior_next_to_the_draft(tmp_path):
    from heterospec import Engine
    from heterospec.vllm_plugin.lookup import LookupSteps
    from tests.engine_util import OracleDraft, tiny_hf_llama

    hf = tiny_hf_llama(seed=11, vocab=16)
    prior = _prior(tried0=200.0, rate=0.2, vocab_size=16)
    save_lookup_prior(prior, str(tmp_path))
    seeded = Engine(hf, OracleDraft(hf, noise=0.8, seed=5), draft_dir=str(tmp_path))
    plain = Engine(hf, OracleDraft(hf, noise=0.8, seed=5))
    assert seeded.lookup_gate.accept(0)[0] < 0.3 and plain.lookup_gate.accept(0)[0] == LookupGate.PRIOR
    assert seeded._new_gate().accept(0) == seeded.lookup_gate.accept(0)       # generate(lookup=True)'s gate too
    steps = LookupSteps(4, prior=load_lookup_prior(str(tmp_path), 16))
    assert steps.gate.accept(0)[0] < 0.3 and LookupSteps(4).gate.accept(0)[0] == LookupGate.PRIOR


def test_the_shipped_prior_is_well_formed_and_ranks_longer_matches_higher():
    from heterospec.defaults import default_draft_dir
    try:
        d = default_draft_dir()
    except Exception as exc:           # (the built-in draft ships in the package)
        pytest.fail(f"no built-in draft directory: {exc}")
    prior = load_lookup_prior(str(d), vocab_size=49152)
    assert prior is not None and prior["prompts"] >= 64 and prior["temperature"] == 0.0
    first = [t[0] and h[0] / t[0] for t, h in zip(prior["tried"][:HISTORY_ROW], prior["hit"][:HISTORY_ROW])]
    assert first == sorted(first) and first[0] < 0.4 < 0.9 < first[-1]


def test_calibrate_lookup_prior_writes_the_file_next_to_the_draft(tmp_path, monkeypatch, capsys):
    import importlib

    import heterospec
    from heterospec.cli import main

    class FakeEngine:
        draft_dir = str(tmp_path / "draft")

    seen = {}

    def fake_measure(engine, prompts, max_new_tokens=128, source="", **kw):
        seen.update(prompts=list(prompts), max_new_tokens=max_new_tokens, source=source)
        return _prior(prompt_source=source)
    monkeypatch.setattr(heterospec.engine.Engine, "from_pretrained", classmethod(lambda cls, *a, **k: FakeEngine()))
    monkeypatch.setattr(importlib.import_module("heterospec.calibrate"), "measure_lookup_prior", fake_measure)
    pf = tmp_path / "p.txt"
    pf.write_text("x\ny\nz\n")
    assert main(["calibrate", "--lookup-prior", "2", "--prompts-file", str(pf), "--max-new-tokens", "16"]) == 0
    assert seen == {"prompts": ["x", "y"], "max_new_tokens": 16, "source": "p.txt"}
    assert load_lookup_prior(str(tmp_path / "draft"))["prompt_source"] == "p.txt"
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'draft' / LOOKUP_PRIOR_FILE}" in out and '"row": "match >= 1"' in out
