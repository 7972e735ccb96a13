"""HeteroSpec in vLLM with tensor parallelism (heterospec/vllm_plugin).

Without vLLM: the TP draft (``tp_draft.py``: a copy of an EAGLE-3 draft whose vocabulary vLLM can
shard across the ranks) and the plugin's clear error for one it cannot. With vLLM 0.32.0 (CI's
vLLM step): how a rank that is not rank 0 follows rank 0's kind of step, and a real run at
``tensor_parallel_size=3`` on the CPU (the built-in target's 9 heads split in 3 only; three
ranks share the machine's cores), whose greedy output equals vLLM autoregressive's at TP 3 with
the path stop and context lookup on.
"""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from heterospec.vllm_plugin.tp_draft import padded_vocab, split_rows, splits, vocab_error, write_tp_draft

from test_vllm_plugin import PROMPTS, _generate, _speculating_costs, needs_vllm


def _pair(tmp_path, rows=128, vocab=512, hidden=8, heads=9, kv_heads=3):
    """A toy target directory (tied embedding) and an EAGLE-3 draft over ``rows`` of its ids."""
    g = torch.Generator().manual_seed(0)
    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir(parents=True)
    draft.mkdir(parents=True)
    embed = torch.randn(vocab, hidden, generator=g)
    save_file({"model.embed_tokens.weight": embed}, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({"vocab_size": vocab, "num_attention_heads": heads,
                                                    "num_key_value_heads": kv_heads}))
    kept = torch.randperm(vocab, generator=g)[:rows].sort().values
    save_file({"lm_head.weight": torch.randn(rows, hidden, generator=g).half(),
               "d2t": kept - torch.arange(rows), "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, kept, True),
               "fc.weight": torch.randn(hidden, 3 * hidden, generator=g).half()}, str(draft / "model.safetensors"))
    (draft / "config.json").write_text(json.dumps({"vocab_size": vocab, "draft_vocab_size": rows,
                                                   "num_attention_heads": heads, "num_key_value_heads": kv_heads}))
    (draft / "acceptance_tables_chain.json").write_text("{}")
    return target, draft, embed, kept


def test_vocabulary_sizes_that_split():
    assert padded_vocab(8192) == 8192 and padded_vocab(8193) == 8256
    assert splits(8192, 2) and splits(8192, 8) and not splits(8192, 3)
    assert split_rows(8192, 3, 49152) == 8256 and splits(8256, 3)
    assert split_rows(100, 6, 49152) == 192
    with pytest.raises(ValueError, match="no draft vocabulary"):
        split_rows(8192, 3, 8200)


def test_tp_draft_keeps_the_drafts_rows_and_adds_the_targets(tmp_path):
    target, draft, embed, kept = _pair(tmp_path)
    before = load_file(str(draft / "model.safetensors"))
    info = write_tp_draft(draft, target, tmp_path / "tp3", 3)
    assert info["tp_draft_vocab"] == 192 and len(info["added_target_ids"]) == 64
    after = load_file(str(tmp_path / "tp3" / "model.safetensors"))
    ids = torch.arange(192) + after["d2t"]
    assert bool((ids[1:] > ids[:-1]).all())                      # the map still rises
    assert set(kept.tolist()) <= set(ids.tolist())
    added = sorted(set(ids.tolist()) - set(kept.tolist()))
    assert added == info["added_target_ids"] and added == sorted(set(range(512)) - set(kept.tolist()))[:64]
    head = after["lm_head.weight"]
    assert head.dtype == torch.float16 and head.shape == (192, 8)
    pos = {t: i for i, t in enumerate(ids.tolist())}
    for r, t in enumerate(kept.tolist()):                       # the draft's own rows, unchanged
        assert torch.equal(head[pos[t]], before["lm_head.weight"][r])
    for t in added:                                             # the target's rows for the others
        assert torch.equal(head[pos[t]], embed[t].half())
    assert after["t2d"].sum() == 192 and bool(after["t2d"][ids].all())
    assert torch.equal(after["fc.weight"], before["fc.weight"])
    cfg = json.loads((tmp_path / "tp3" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 192 and splits(192, 3)
    assert (tmp_path / "tp3" / "acceptance_tables_chain.json").exists()
    assert json.loads((tmp_path / "tp3" / "tp_draft.json").read_text())["tp"] == 3


def test_tp_draft_errors_name_the_problem(tmp_path):
    target, draft, _, _ = _pair(tmp_path)
    with pytest.raises(ValueError, match="target's 9 attention heads do not split across 2"):
        write_tp_draft(draft, target, tmp_path / "x", 2)
    with pytest.raises(ValueError, match="tp must be an integer >= 2"):
        write_tp_draft(draft, target, tmp_path / "x", 1)
    with pytest.raises(ValueError, match="another directory"):
        write_tp_draft(draft, target, draft, 3)
    with pytest.raises(ValueError, match="has no config.json"):
        write_tp_draft(tmp_path / "nowhere", target, tmp_path / "x", 3)
    t2, d2, _, _ = _pair(tmp_path / "b", rows=192, heads=6, kv_heads=3)
    with pytest.raises(ValueError, match="already splits across 3"):
        write_tp_draft(d2, t2, tmp_path / "x", 3)
    with pytest.raises(ValueError, match="draft's 3 key value heads do not split across 2"):
        t3, d3, _, _ = _pair(tmp_path / "c", heads=6, kv_heads=3)
        cfg = json.loads((t3 / "config.json").read_text())
        (t3 / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 2}))
        write_tp_draft(d3, t3, tmp_path / "x", 2)


def test_the_plugin_refuses_a_draft_vocabulary_that_does_not_split():
    assert vocab_error(8192, 1, "d") is None and vocab_error(8192, 2, "d") is None and vocab_error(None, 3, "d") is None
    msg = vocab_error(8192, 3, "/drafts/x")
    assert "8192-token vocabulary does not split across 3" in msg and "tp-draft --tp 3 --draft /drafts/x" in msg
    from heterospec.vllm_plugin.options import HeteroSpecSetupError
    from heterospec.vllm_plugin.patch import check_config
    spec = SimpleNamespace(method="eagle3", model="/drafts/x", draft_model_config=SimpleNamespace(
        hf_config=SimpleNamespace(draft_vocab_size=8192, vocab_size=49152)))
    cfg = SimpleNamespace(speculative_config=spec, parallel_config=SimpleNamespace(tensor_parallel_size=3),
                          scheduler_config=SimpleNamespace(async_scheduling=False))
    with pytest.raises(HeteroSpecSetupError, match="does not split across 3"):
        check_config(cfg)
    cfg.parallel_config.tensor_parallel_size = 1
    check_config(cfg)


class _Group:
    """A TP group whose broadcasts deliver what rank 0 sent (set by the test)."""
    def __init__(self, sent):
        self.sent, self.world_size, self.rank_in_group = sent, 3, 1

    def broadcast(self, tensor, src=0):
        assert src == 0
        return torch.as_tensor(self.sent.pop(0), dtype=tensor.dtype)


@needs_vllm
def test_a_follower_rank_runs_rank0s_kind_of_step():
    """A rank other than 0 runs the forwards rank 0 runs, whatever its own plan: rank 0's lookup
    step (warm forward or not; the follower proposes and learns nothing), its drafting step with
    a plan of its own when it planned none, its plain step."""
    from heterospec.policy import Plan
    from heterospec.vllm_plugin.proposer import HeteroSpecProposer, LOOKUP, LOOKUP_WARM, PLAIN, SPECULATE, WARM
    prop = HeteroSpecProposer.__new__(HeteroSpecProposer)
    prop.device, prop.tp_follower = torch.device("cpu"), True
    mine = Plan("fitted", speculate=False, binned=False)
    prop.tp_group = _Group([[LOOKUP_WARM], [LOOKUP], [SPECULATE], [SPECULATE], [WARM], [PLAIN]])
    assert prop._follow_rank0(PLAIN, None, mine) == (LOOKUP_WARM, (None, True), mine)
    assert prop._follow_rank0(SPECULATE, None, mine)[:2] == (LOOKUP, (None, False))
    mode, chosen, plan = prop._follow_rank0(LOOKUP, ("my round", True), None)     # it chose a lookup, rank 0 did not
    assert mode == SPECULATE and chosen is None and plan.speculate and plan.budget == [1]
    mode, _, plan = prop._follow_rank0(PLAIN, None, mine)
    assert mode == SPECULATE and plan.name == "follow"
    mode, chosen, plan = prop._follow_rank0(LOOKUP, ("my round", False), None)
    assert mode == WARM and chosen is None and not plan.speculate
    assert prop._follow_rank0(SPECULATE, None, mine) == (PLAIN, None, mine)
    prop.tp_follower = False                 # rank 0 keeps its own choice
    prop.tp_group = _Group([[LOOKUP]])
    assert prop._follow_rank0(LOOKUP, ("my round", False), None) == (LOOKUP, ("my round", False), None)


TP_PROMPTS = ["Repeat this line three times: the quick brown fox jumps over the lazy dog.", *PROMPTS[:3]]


@needs_vllm
@pytest.mark.slow
def test_vllm_heterospec_at_tp3_greedy_equals_autoregressive(tmp_path):
    """vLLM at tensor_parallel_size=3 on the CPU (gloo; three ranks share the cores). The shipped
    draft (8,192 rows) stops at start with a message naming ``tp-draft``; its TP copy (8,256 rows)
    with frozen costs that speculate runs: every rank runs rank 0's steps (lookup, drafting with
    the path stop, plain), and the greedy output is vLLM autoregressive's at TP 3. The lookup gate
    starts as on a device where copied chains paid (``copies_paid``): with a draft whose chains
    predict more than copies do (run 6 on, 4 Dec 2026) rank 0 would otherwise never look up here."""
    from heterospec.defaults import default_draft_dir, default_target_dir
    draft = tmp_path / "draft-tp3"
    write_tp_draft(default_draft_dir(), default_target_dir(), draft, 3)
    common = ["--tp", "3", "--batch", "4", "--max-new-tokens", "32", "--max-model-len", "512"]
    # the engine core in the test's process (its three ranks are still processes of their own):
    # one interpreter fewer to start per engine
    inproc = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    r = _generate(tmp_path, "--method", "heterospec", "--k", "4", *common, check=False, env=inproc)   # shipped draft
    assert r.returncode != 0
    out = r.stdout + r.stderr          # vLLM's workers log their errors to stdout
    assert "8192-token vocabulary does not split across 3" in out and "tp-draft --tp 3" in out, out[-3000:]
    ar = _generate(tmp_path, "--method", "autoregressive", *common, prompts=TP_PROMPTS, env=inproc)
    trace = tmp_path / "trace.jsonl"
    hs = _generate(tmp_path, "--method", "heterospec", "--k", "4", "--draft", str(draft), *common,
                   "--options", _speculating_costs(tmp_path / "costs.json", copies_paid=True, kmax=4),
                   prompts=TP_PROMPTS, env={**inproc, "HETEROSPEC_VLLM_TRACE": str(trace)})
    assert hs[4]["token_ids"] == ar[4]["token_ids"]
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    by_rank = {}
    for s in steps:
        by_rank.setdefault(s["pid"], []).append(s)
    assert len(by_rank) == 3 and len({len(v) for v in by_rank.values()}) == 1, {p: len(v) for p, v in by_rank.items()}
    leader = [p for p, v in by_rank.items() if any(s["lookup"] for s in v) or any(s["path_stop"] for s in v)]
    assert len(leader) == 1, "rank 0 alone decides lookups and path stops"
    lead = by_rank[leader[0]]
    assert any(s["path_stop"] for s in lead) and any(s["lookup"] for s in lead), lead[:20]
    assert hs[4]["spec"].get("num_draft_tokens", 0) > 0, hs[4]["spec"]
    for pid, rank in by_rank.items():          # the same forwards on every rank, step by step
        for a, b in zip(lead, rank):
            assert (a["plan"] == "lookup") == (b["plan"] == "lookup"), (pid, a, b)
            assert (a["draft_ms"] > 0) == (b["draft_ms"] > 0) and (a["warm_ms"] > 0) == (b["warm_ms"] > 0), (pid, a, b)
