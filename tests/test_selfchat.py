"""The selfchat prompt source: user turns the target writes itself (heterospec.train.selfchat),
on a tiny random Llama with a stub chat tokenizer."""

from __future__ import annotations

import json
import random

import pytest
import torch

pytest.importorskip("transformers")

from heterospec.datasets import MissingDataError  # noqa: E402
from heterospec.train import prompts as TP  # noqa: E402
from heterospec.train import selfchat as S  # noqa: E402

VOCAB, EOS, IM_END = 64, 2, 3


class ChatTokenizer:
    """Token i <-> word "w{i}"; "<|im_end|>" is token IM_END; a ChatML-like template."""
    eos_token_id = EOS

    def apply_chat_template(self, messages, tokenize=False):
        assert not tokenize
        return "<sys> be helpful <end> <user> " + " ".join(m["content"] for m in messages) + " <end>"

    def __call__(self, text, add_special_tokens=False):
        words = text.split()
        return {"input_ids": [4 + (sum(map(ord, w)) % (VOCAB - 4)) for w in words]}

    def convert_tokens_to_ids(self, tok):
        return IM_END if tok == "<|im_end|>" else None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, eos_token_id=EOS, pad_token_id=EOS)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():   # end-of-turn likely enough that turns of ~5-15 tokens end
        m.lm_head.bias = None
        m.lm_head.weight.mul_(0.1)
        m.lm_head.weight[IM_END] = m.lm_head.weight.mean(0) + 0.0
    return m


def test_the_prefix_is_the_template_up_to_the_users_words():
    assert S.user_turn_prefix(ChatTokenizer()) == "<sys> be helpful <end> <user> "

    class Paraphrasing(ChatTokenizer):
        def apply_chat_template(self, messages, tokenize=False):
            return "<user> something else <end>"

    with pytest.raises(ValueError, match="verbatim"):
        S.user_turn_prefix(Paraphrasing())


def test_clean_user_turn_keeps_closed_requests_only():
    ok = "Can you explain how tides work?"
    assert S.clean_user_turn("  " + ok + "\n", True) == ok
    assert S.clean_user_turn(ok, False) is None                     # ran on into an answer
    assert S.clean_user_turn("Hi there", True) is None              # too short
    assert S.clean_user_turn(" ".join(["word"] * (S.MAX_WORDS + 1)), True) is None
    assert S.clean_user_turn("Tell me about <|im_start|> things please", True) is None
    assert S.clean_user_turn("Get the latest edition of [book_title] for me", True) is None


def test_sampling_stops_at_the_end_of_turn_and_is_seeded(model):
    tok = ChatTokenizer()
    a = S.sample_user_turns(model, tok, 12, max_new_tokens=10, generator=torch.Generator().manual_seed(1))
    b = S.sample_user_turns(model, tok, 12, max_new_tokens=10, generator=torch.Generator().manual_seed(1))
    assert a == b and len(a) == 12
    assert any(f for _, f in a) and any(not f for _, f in a)
    for text, fin in a:
        assert f"w{IM_END}" not in text.split() and f"w{EOS}" not in text.split()
        if not fin:
            assert len(text.split()) == 10          # ran to the budget
    with pytest.raises(ValueError, match="temperature"):
        S.sample_user_turns(model, tok, 2, temperature=0.0)


def test_every_turn_is_drawn_from_its_own_rows_distribution(model):
    """Finished rows leave the batch and its KV cache: every token of every turn must lie in the
    top-p nucleus of its own row's distribution, recomputed from scratch without a cache (a
    wrongly compacted cache samples rows from each other's distributions)."""
    tok = ChatTokenizer()
    top_p = 0.3
    turns = S.sample_user_turns(model, tok, 16, max_new_tokens=12, top_p=top_p,
                                generator=torch.Generator().manual_seed(3))
    lengths = {len(t.split()) for t, _ in turns}
    assert len(lengths) > 2                      # rows left the batch at different steps
    prefix = tok(S.user_turn_prefix(tok))["input_ids"]
    checked = 0
    for text, _ in turns:
        ids = [int(w[1:]) for w in text.split()]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prefix + ids])).logits[0, len(prefix) - 1:]
        for j, t in enumerate(ids):
            p, order = torch.softmax(logits[j].float(), -1).sort(descending=True)
            nucleus = order[:int((p.cumsum(0) - p < top_p).sum())].tolist()
            assert t in nucleus, (text, j)
            checked += 1
    assert checked > 40


def test_run_resumes_an_interrupted_chunk_to_the_same_file(model, tmp_path, monkeypatch):
    monkeypatch.setattr(S, "MIN_WORDS", 1)
    tok = ChatTokenizer()
    kw = dict(batch=8, max_new_tokens=10, model=model, tokenizer=tok, log=lambda *a: None)
    whole = tmp_path / "whole.jsonl"
    res = S.run_selfchat(whole, 24, **kw)
    assert res["chunks_done"] == 3 and res["turns"] > 0
    # a run killed inside chunk 2: its turns written, its "done" line not
    cut = tmp_path / "cut.jsonl"
    lines = whole.read_text().splitlines()
    cut.write_text("\n".join(lines[:-1]) + "\n")
    rows, done = S.read_user_turns(cut)
    assert set(done) == {0, 1} and all(r["chunk"] < 2 for r in rows)
    res2 = S.run_selfchat(cut, 24, **kw)
    assert res2["chunks_done"] == 3
    assert S.read_user_turns(cut)[0] == S.read_user_turns(whole)[0]
    texts = [r["text"] for r in S.read_user_turns(whole)[0]]
    assert len(texts) == len({" ".join(t.lower().split()) for t in texts})     # no duplicates
    with pytest.raises(ValueError, match="seed"):
        S.run_selfchat(whole, 32, seed=5, **kw)


def test_selfchat_is_a_training_prompt_source(tmp_path, monkeypatch):
    path = tmp_path / "turns.jsonl"
    rows = [{"id": f"selfchat/0/0/{j}", "chunk": 0, "text": f"Please explain topic number {j} to me."}
            for j in range(5)]
    rows.append({"id": "selfchat/0/1/0", "chunk": 1, "text": "an unfinished chunk's turn"})
    path.write_text("\n".join(json.dumps(r) for r in rows)
                    + "\n" + json.dumps({"chunk": 0, "done": True, "seed": 0}) + "\n")
    monkeypatch.setenv("HETEROSPEC_SELFCHAT", str(path))
    got = TP._selfchat_prompts(10, random.Random(0))
    assert sorted(p.text for p in got) == sorted(r["text"] for r in rows[:5])
    assert all(p.source == "selfchat:target" for p in got)
    assert "selfchat" in TP.source_info(["selfchat"]) and TP.source_info(["selfchat"])["selfchat"]["licence"]
    mixed = TP.build_training_prompts(8, seed=0, mix={"selfchat": 0.5, "math": 0.5})
    assert {p.source.split(":")[0] for p in mixed} == {"selfchat", "math"}
    with pytest.raises(ValueError, match="unknown training prompt source"):
        TP.build_training_prompts(4, mix={"selfchat": 0.5, "reddit": 0.5})
    monkeypatch.setenv("HETEROSPEC_SELFCHAT", str(tmp_path / "missing.jsonl"))
    with pytest.raises(MissingDataError, match="train-draft selfchat"):
        TP._selfchat_prompts(3, random.Random(0))
    with pytest.warns(UserWarning, match="selfchat"):
        only_math = TP.build_training_prompts(4, seed=0, mix={"selfchat": 0.5, "math": 0.5})
    assert {p.source.split(":")[0] for p in only_math} == {"math"}


def test_task_openings_cycle_through_every_kind_and_its_phrases():
    kinds = list(S.TASK_OPENINGS)
    assert S.chunk_opening(5) == (None, "")
    got = [S.chunk_opening(c, "tasks") for c in range(len(kinds) * 2)]
    assert [k for k, _ in got[:len(kinds)]] == kinds            # one kind per chunk, in turn
    for kind, phrase in got:
        assert phrase in S.TASK_OPENINGS[kind]
    assert got[0][1] != got[len(kinds)][1]                       # the next round takes the next phrase
    with pytest.raises(ValueError, match="openings"):
        S.chunk_opening(0, "topics")


def test_a_turn_under_an_opening_starts_with_it_and_continues_from_it(model):
    """The opening is part of the prefix the model continues (the same tokens as sampling from
    prefix + opening directly), and the kept text is the opening plus the continuation."""
    tok = ChatTokenizer()
    opening = "Write a"
    turns = S.sample_user_turns(model, tok, 6, max_new_tokens=8, generator=torch.Generator().manual_seed(4),
                                opening=opening)
    assert all(t.startswith(opening + "w") or t == opening for t, _ in turns)

    class Prefixed(ChatTokenizer):                # the same prefix, written into the template
        def apply_chat_template(self, messages, tokenize=False):
            return "<sys> be helpful <end> <user> Write a" + " ".join(m["content"] for m in messages) + " <end>"

    plain = S.sample_user_turns(model, Prefixed(), 6, max_new_tokens=8, generator=torch.Generator().manual_seed(4))
    assert [opening + t for t, _ in plain] == [t for t, _ in turns]


def test_a_run_with_openings_tags_its_turns_and_keeps_its_setting(model, tmp_path, monkeypatch):
    monkeypatch.setattr(S, "MIN_WORDS", 1)
    tok = ChatTokenizer()
    kw = dict(batch=8, max_new_tokens=16, model=model, tokenizer=tok, log=lambda *a: None)
    out = tmp_path / "tasks.jsonl"
    S.run_selfchat(out, 24, openings="tasks", **kw)
    rows, done = S.read_user_turns(out)
    assert done == {0: "tasks", 1: "tasks", 2: "tasks"} and rows
    for r in rows:
        kind, opening = S.chunk_opening(r["chunk"], "tasks")
        assert r["kind"] == kind and r["text"].startswith(opening.strip())
    with pytest.raises(ValueError, match="openings"):          # one setting per file
        S.run_selfchat(out, 32, **kw)
    plain = tmp_path / "plain.jsonl"
    S.run_selfchat(plain, 8, **kw)
    with pytest.raises(ValueError, match="openings"):
        S.run_selfchat(plain, 16, openings="tasks", **kw)
    with pytest.raises(ValueError, match="openings"):
        S.run_selfchat(tmp_path / "x.jsonl", 4, openings="topics", **kw)
    monkeypatch.setenv("HETEROSPEC_SELFCHAT", str(out))
    got = TP._selfchat_prompts(100, random.Random(0))
    assert {p.source for p in got} == {f"selfchat:{r['kind']}" for r in rows}
