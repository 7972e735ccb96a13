"""The lookup corpus (heterospec.datastore): the longest match and the chain against a brute-force
reference, grades, bad input, files and caches; the gate's corpus rows; corpus chains in the
engine keep greedy output identical to autoregressive's (the sampling law: tests/test_lookup.py);
the builder (heterospec.train.corpus) and the shipped corpus."""

import json
import os
import random

import numpy as np
import pytest

import torch

from heterospec import Engine, ops
from heterospec.datastore import CORPUS_FILE, SEP, CorpusIndex, corpus_for, save_corpus
from heterospec.lookup import CORPUS_ROW, CORPUS_SOURCE, HISTORY_ROW, MATCH_BUCKETS, SOURCES, LookupGate, proposal_row
from tests.engine_util import OracleDraft, tiny_hf_llama
from tests.test_lookup import CFG, CorpusFirstGate, _repetitive_prompts, _taught, forced_lookup_run


def _corpus(rng, vocab, docs, length):
    toks = []
    for _ in range(docs):
        toks += [rng.randrange(vocab) for _ in range(rng.randrange(1, length))] + [SEP]
    return toks


def reference_match(toks, context, nmax=CorpusIndex.NMAX):
    """Longest n <= nmax such that context[-n:] occurs in toks (not across SEP); the forward
    positions where those occurrences' continuations start."""
    ctx = [int(x) for x in context]
    best = (0, [])
    for n in range(1, min(nmax, len(ctx)) + 1):
        pat = ctx[-n:]
        if any(not 0 <= x < SEP for x in pat):
            break
        starts = [i + n for i in range(len(toks) - n + 1) if toks[i:i + n] == pat]
        if not starts:
            break
        best = (n, starts)
    return best


def reference_chain(toks, starts, k, agree=CorpusIndex.AGREE):
    """Per position the most common continuation token among the occurrences that agreed so far
    (the smallest token on a tie), while it holds ``agree`` of them and is not SEP."""
    pad = list(toks) + [SEP] * (k + 1)
    rows = [pad[s:s + k] for s in starts]
    chain = []
    for j in range(k):
        col = [r[j] for r in rows]
        counts = {}
        for t in col:
            counts[t] = counts.get(t, 0) + 1
        t = min(counts, key=lambda x: (-counts[x], x))
        if t == SEP or counts[t] < agree * len(col):
            break
        chain.append(t)
        rows = [r for r in rows if r[j] == t]
    return chain


@pytest.mark.parametrize("vocab", [2, 3, 6])
def test_corpus_match_and_chain_are_what_the_reference_finds(vocab):
    rng = random.Random(vocab)
    for trial in range(25):
        toks = _corpus(rng, vocab, rng.randrange(1, 6), 40)
        index = CorpusIndex(toks)
        for _ in range(12):
            context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
            n, count = index.match(context)
            rn, starts = reference_match(toks, context)
            assert n == rn and count == len(starts), (toks, context)
            k = rng.choice([1, 3, 8])
            chain, grade = index.propose(context, k)
            if rn < CorpusIndex.MIN_MATCH or len(starts) > CorpusIndex.SAMPLE:
                assert rn >= CorpusIndex.MIN_MATCH or (chain, grade) == ([], 0)
                continue
            want = reference_chain(toks, starts, k)
            assert chain == want
            assert (grade == 0) == (not chain) and 0 <= grade <= 5


def test_corpus_grades_its_first_token_by_agreement_and_support():
    A, B = [1, 2, 3], [9]
    # six documents continue 1 2 3 with 4: grade 5; two of them: 4; a single one: 2 (short match)
    many = CorpusIndex((A + [4, 5, SEP]) * 6)
    assert many.propose([7] + A, 4) == ([4, 5], 5)
    assert CorpusIndex((A + [4, SEP]) * 2).propose(A, 4) == ([4], 4)
    assert CorpusIndex(A + [4, SEP]).propose(A, 4) == ([4], 2)
    long = [1, 2, 3, 5, 6, 7]
    assert CorpusIndex(long + [4, SEP]).propose(long, 4) == ([4], 3)
    # 3 of 4 agree: grade 4; 2 of 4 (a tie, the smaller token): grade 2; 1 of 3: no chain
    assert CorpusIndex((A + [4, SEP]) * 3 + A + [8, SEP]).propose(A, 2) == ([4], 4)
    assert CorpusIndex((A + [4, SEP]) * 2 + (A + [8, SEP]) * 2).propose(A, 2) == ([4], 2)
    assert CorpusIndex(A + [4, SEP] + A + [8, SEP] + A + [6, SEP]).propose(A, 2) == ([], 0)
    # a match shorter than MIN_MATCH, an unknown token, k = 0: nothing
    assert CorpusIndex(A + [4, SEP]).propose([2, 3], 4) == ([], 0)
    assert CorpusIndex(A + [4, SEP]).propose(B + A, 0) == ([], 0)
    assert CorpusIndex(A + [4, SEP]).propose(A + [70000], 3) == ([], 0)
    assert CorpusIndex(A + [4, SEP]).match([-1] + A) == (3, 1)
    # a chain stops at the end of its document
    assert CorpusIndex(A + [4]).propose(A, 4) == ([4], 2)


def test_corpus_lookup_op_samples_evenly_and_rejects_bad_arguments():
    # 10 occurrences of 1 2 3; reading 4 of them takes occurrences i * 9 // 3 = 0, 3, 6, 9 of their
    # range of the suffix order
    docs = [[1, 2, 3, t, SEP] for t in (5, 5, 5, 6, 6, 6, 6, 6, 6, 7)]
    toks = [x for d in docs for x in d]
    index = CorpusIndex(toks)
    corpus, order = index._tokens, index._order
    N = len(toks)
    rng_ = [i for i in range(N) if toks[N - 1 - int(order[i]) - 2:N - int(order[i])] == [1, 2, 3]]
    assert rng_ == list(range(rng_[0], rng_[0] + 10))                      # one range
    read = [toks[N - int(order[rng_[i * 9 // 3]])] for i in range(4)]
    top = max(sorted(set(read)), key=read.count)
    ctx = torch.tensor([1, 2, 3])
    chain, match = ops.corpus_lookup(corpus, order, ctx, 2, 3, 16, 4, 0.5)
    assert match.tolist() == [3, 10, 4, read.count(top)]
    assert chain.tolist() == ([top, -1] if read.count(top) >= 2 else [-1, -1])
    # with every occurrence read: 6 of 10 continue with 6
    chain, match = ops.corpus_lookup(corpus, order, ctx, 2, 3, 16, 64, 0.5)
    assert chain.tolist() == [6, -1] and match.tolist() == [3, 10, 10, 6]
    assert ops.corpus_lookup(corpus, order, ctx, 2, 4, 16, 64, 0.5)[0].tolist() == [-1, -1]      # min_match
    assert ops.corpus_lookup(corpus, order, ctx, 0, 3, 16, 64, 0.5)[1].tolist() == [3, 10, 0, 0]   # k = 0
    bad = [
        ((corpus.long(), order, ctx, 2, 3, 16, 64, 0.5), "corpus of dtype torch.int32"),
        ((corpus, order[:-1].clone(), ctx, 2, 3, 16, 64, 0.5), "N = corpus.size"),
        ((corpus, order, ctx.int(), 2, 3, 16, 64, 0.5), "context of dtype torch.int64"),
        ((corpus, order, ctx, -1, 3, 16, 64, 0.5), "k >= 0"),
        ((corpus, order, ctx, 2, 5, 4, 64, 0.5), "min_match <= max_match"),
        ((corpus, order, ctx, 2, 3, 16, 0, 0.5), "sample >= 1"),
        ((corpus, order, ctx, 2, 3, 16, 64, 1.5), "0 <= agree <= 1"),
        ((corpus[::2].contiguous(), order[::2].contiguous(), ctx, 2, 3, 16, 64, 0.5), None),
    ]
    for args, msg in bad[:-1]:
        with pytest.raises(ValueError, match=msg):
            ops.corpus_lookup(*args)
        with pytest.raises((ValueError, RuntimeError), match=msg.replace("torch.", "")[:12]):
            torch.ops.heterospec.corpus_lookup.default(*args)
    # a suffix order with an entry outside [0, N): an error where it is read, never a bad read
    broken = order.clone()
    broken[:] = 10 ** 6
    with pytest.raises(ValueError, match="suffix_order values in"):
        ops.corpus_lookup(corpus, broken, ctx, 2, 3, 16, 64, 0.5)
    with pytest.raises(ValueError, match="on the CPU"):
        ops.corpus_lookup(corpus.to("meta"), order, ctx, 2, 3, 16, 64, 0.5)


def test_corpus_rejects_bad_tokens_and_reads_only_its_own_files(tmp_path):
    for bad in ([], [[1, 2], [3, 4]], [1.5, 2.0], [-1, 2], [SEP + 1]):
        with pytest.raises(ValueError, match="CorpusIndex"):
            CorpusIndex(np.array(bad))
    path = tmp_path / "c.npz"
    save_corpus(str(path), [1, 2, 3, 4, SEP, 1, 2, 3, 5], {"vocab_size": 8})
    again = CorpusIndex.load(str(path))
    assert again.meta["vocab_size"] == 8 and len(again) == 9
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not a lookup corpus"):
        CorpusIndex.load(str(tmp_path / "other.npz"))
    np.savez(tmp_path / "future.npz", tokens=np.zeros(3, np.uint16),
             meta=np.frombuffer(json.dumps({"format": 99}).encode(), np.uint8))
    with pytest.raises(ValueError, match="format 99"):
        CorpusIndex.load(str(tmp_path / "future.npz"))


def test_corpus_for_a_draft_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path / "cache"))
    assert corpus_for(None) is None and corpus_for(str(tmp_path)) is None        # no file: none
    save_corpus(str(tmp_path / CORPUS_FILE), [1, 2, 3, 4, SEP] * 3, {"vocab_size": 16})
    index = corpus_for(str(tmp_path), 16)
    assert index is not None and index.propose([1, 2, 3], 2) == ([4], 4)
    assert corpus_for(str(tmp_path), 16) is index                               # once per process
    # its suffix order is kept in the cache, and read from there
    cached = list((tmp_path / "cache" / "datastore").glob("*.npy"))
    assert len(cached) == 1
    monkeypatch.setattr(np, "lexsort", lambda *a: (_ for _ in ()).throw(AssertionError("sorted again")))
    assert CorpusIndex([1, 2, 3, 4, SEP] * 3, cache_dir=str(cached[0].parent)).propose([1, 2, 3], 2) == ([4], 4)
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="vocabulary of 16 tokens"):
        assert corpus_for(str(tmp_path), 32) is None
    # a cache that cannot be written (its directory is a file): sorted in this process, no error
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    assert CorpusIndex([1, 2, 3, 4, SEP] * 3, cache_dir=str(blocked / "datastore")).propose([1, 2, 3], 2) == ([4], 4)
    # a damaged file: a warning, no corpus, and an engine still starts
    bad = tmp_path / "damaged"
    bad.mkdir()
    (bad / CORPUS_FILE).write_bytes(b"not a zip")
    with pytest.warns(UserWarning, match="could not be read"):
        assert corpus_for(str(bad), 16) is None


def test_gate_keeps_corpus_rows_by_grade_and_takes_up_older_states():
    assert SOURCES[CORPUS_SOURCE] == "corpus" and CORPUS_ROW == 2 * len(MATCH_BUCKETS)
    assert [proposal_row(([1], g, CORPUS_SOURCE)) for g in (1, 2, 3, 4, 5)] == list(range(CORPUS_ROW, CORPUS_ROW + 5))
    gate = LookupGate(kmax=4)
    # before evidence: own context first, then the history, then the corpus
    assert gate.better(([1, 2], 2), ([5], 2), ([7, 8], 5)) == ([1, 2], 2)
    assert gate.better(([], 0), ([], 0), ([7, 8], 5)) == ([7, 8], 5, CORPUS_SOURCE)
    _taught(gate, CORPUS_ROW + 4, 0.9)
    _taught(gate, 1, 0.2, seed=1)
    assert gate.better(([1, 2, 3], 2), ([], 0), ([7, 8, 9], 5)) == ([7, 8, 9], 5, CORPUS_SOURCE)
    r = gate.choose([([7, 8, 9], 5, CORPUS_SOURCE)], lambda mean, most: 10.0 + 0.1 * most, 50.0)
    assert r is not None and r.buckets == [CORPUS_ROW + 4]
    # a state saved before the corpus's rows: taken up, the corpus's rows at the prior
    old = {"kmax": 4, "buckets": list(MATCH_BUCKETS), "sources": ["context", "history"],
           "tried": [[2.0] * 4] * (2 * len(MATCH_BUCKETS)), "hit": [[2.0] * 4] * (2 * len(MATCH_BUCKETS)),
           "time": {"lookup": {}, "plain": {}}}
    fresh = LookupGate(kmax=4)
    assert fresh.load_state(old) is True
    assert fresh.accept(CORPUS_ROW)[0] == LookupGate.PRIOR and fresh.accept(HISTORY_ROW)[0] != LookupGate.PRIOR
    assert fresh.load_state(dict(old, sources=["history", "context"])) is False


@pytest.mark.parametrize("batch", [1, 3])
def test_corpus_chains_are_greedy_lossless(batch):
    hf = tiny_hf_llama(seed=11, vocab=16)
    draft = OracleDraft(hf, noise=0.8, seed=5)
    engine = Engine(hf, draft, config=CFG)
    assert engine.lookup_corpus is None                 # no draft directory, no corpus
    engine.target.config.eos_token_ids = ()
    prompts = _repetitive_prompts(hf.config.vocab_size, batch, seed=batch + 30)
    ar = engine.generate_batch(prompts, max_new_tokens=30, method="autoregressive", chat=False)
    # a corpus that holds the target's own greedy answers (and noise around them)
    rng = random.Random(batch)
    toks = []
    for p, r in zip(prompts, ar):
        toks += p[-3:] + r.token_ids + [SEP] + [rng.randrange(16) for _ in range(50)] + [SEP]
    engine.lookup_corpus = CorpusIndex(toks)
    hs = forced_lookup_run(engine, draft, prompts, CorpusFirstGate)
    assert [r.token_ids for r in hs] == [r.token_ids for r in ar]
    recs = [r for x in hs for r in x.stats.records]
    assert any(r.corpus and r.lookup for r in recs) and any(r.corpus and r.accept_len > 0 for r in recs)
    assert not any(r.corpus and r.history for r in recs)
    # corpus=False: the same tokens, no chain from the corpus
    off = forced_lookup_run(engine, draft, prompts, CorpusFirstGate, corpus=False)
    assert [r.token_ids for r in off] == [r.token_ids for r in ar]
    assert not any(r.corpus for x in off for r in x.stats.records)


def test_corpus_switch_is_checked():
    hf = tiny_hf_llama(seed=11, vocab=16)
    engine = Engine(hf, OracleDraft(hf), config=CFG)
    with pytest.raises(ValueError, match="corpus must be True, False or None"):
        engine.generate([1, 2, 3], max_new_tokens=2, chat=False, corpus="yes")
    with pytest.raises(ValueError, match="no lookup corpus"):
        engine.generate([1, 2, 3], max_new_tokens=2, chat=False, corpus=True)
    assert Engine(hf, OracleDraft(hf), config=CFG, lookup=False).lookup_corpus is None


def _shard(path, seqs, prompt_lens, sampled):
    from safetensors.numpy import save_file

    toks = np.concatenate([np.array(s, np.uint16) for s in seqs])
    offs = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    save_file({"tokens": toks, "seq_offsets": offs, "prompt_lens": np.array(prompt_lens, np.int32),
               "sampled": np.array(sampled, np.uint8)}, str(path))


def test_builder_takes_greedy_answers_of_checked_data_only(tmp_path):
    from heterospec.train.corpus import build_corpus

    d = tmp_path / "distill"
    d.mkdir()
    _shard(d / "shard_00000.safetensors", [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], [7, 7, 8, 8]], [3, 3, 2], [0, 1, 0])
    (d / "manifest.json").write_text(json.dumps({"vocab_size": 16, "config": {"disjoint": True}}))
    with pytest.raises(ValueError, match="not checked against the benchmark sets"):
        build_corpus([str(d)], str(tmp_path / "c.npz"))
    (d / "disjointness.json").write_text("{}")
    meta = build_corpus([str(d)], str(tmp_path / "c.npz"), head=2)
    index = CorpusIndex.load(str(tmp_path / "c.npz"))
    # the sampled answer is left out; each greedy answer keeps the last 2 prompt tokens
    assert list(index.tokens()) == [2, 3, 4, 5, 6, SEP, 7, 7, 8, 8, SEP]
    assert meta["sources"][str(d)] == {"answers": 2, "response_tokens": 5} and meta["vocab_size"] == 16
    with pytest.raises(ValueError, match="no manifest"):
        build_corpus([str(tmp_path)], str(tmp_path / "x.npz"))


def test_the_shipped_corpus_belongs_to_the_built_in_target():
    from heterospec.defaults import default_draft_dir

    path = os.path.join(str(default_draft_dir()), CORPUS_FILE)
    with np.load(path) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        toks = z["tokens"]
    assert meta["vocab_size"] == 49152 and meta["greedy_only"] is True
    assert toks.dtype == np.uint16 and len(toks) == meta["tokens"] > 1_000_000
    assert int(toks[toks != SEP].max()) < 49152
