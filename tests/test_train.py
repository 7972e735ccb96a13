"""Draft training pipeline on a tiny random Llama: distillation shards, vocab maps, loss, resume.

Fast (a few seconds); no packages beyond torch/transformers/safetensors are needed, except the
prompt-disjointness tests which skip when their data packages are absent."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from heterospec.train import distill as D  # noqa: E402
from heterospec.train import trainer as T  # noqa: E402

VOCAB = 96
EOS = 2


def tiny_target(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=EOS, pad_token_id=EOS, bos_token_id=1)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a peaky next-token distribution, so that there is something to learn
        m.model.norm.weight.mul_(8.0)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def make_data(tmp_path, target, n_shards: int = 2, per_shard: int = 6, max_new: int = 12, seed=0):
    rng = random.Random(seed)
    out = tmp_path / "distill"
    out.mkdir(exist_ok=True)
    for s in range(n_shards):
        prompts = [[1] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 9))]
                   for _ in range(per_shard)]
        sampled = [i % 3 == 2 for i in range(per_shard)]
        res = D.generate_with_taps(target, prompts, max_new, [EOS], sampled=sampled,
                                   generator=torch.Generator().manual_seed(s), pad_id=EOS)
        seqs = [D.Sequence_(prompt_id=f"p{s}-{i}", tokens=r["tokens"], prompt_len=r["prompt_len"],
                            features=r["features"], final_hidden=r["final_hidden"],
                            sampled=sampled[i], finished=r["finished"],
                            target_argmax=r["target_argmax"])
                for i, r in enumerate(res)]
        D.write_shard(out / f"shard_{s:05d}.safetensors", seqs)
    (out / "manifest.json").write_text(json.dumps({"vocab_size": VOCAB, "num_layers": 6,
                                                   "hidden_size": 32}))
    return out


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_token_only_generation_writes_what_the_tapped_one_does(target):
    """taps=False (token-only shards) skips the hooks, not a token: same tokens, argmax, ends."""
    prompts = [[1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14], [1, 3]]
    sampled = [False, True, False]
    kw = dict(sampled=sampled, pad_id=EOS)
    with_taps = D.generate_with_taps(target, prompts, 8, [EOS],
                                     generator=torch.Generator().manual_seed(3), **kw)
    tokens_only = D.generate_with_taps(target, prompts, 8, [EOS], taps=False,
                                       generator=torch.Generator().manual_seed(3), **kw)
    assert not target.model.layers[2]._forward_pre_hooks  # no hook left behind
    for a, b in zip(with_taps, tokens_only):
        assert b["features"] is None and b["final_hidden"] is None
        assert torch.equal(a["tokens"], b["tokens"])
        assert torch.equal(a["target_argmax"], b["target_argmax"])
        assert (a["finished"], a["prompt_len"]) == (b["finished"], b["prompt_len"])


def test_taps_match_full_forward(target):
    prompts = [[1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14]]
    res = D.generate_with_taps(target, prompts, 6, [EOS], pad_id=EOS)
    L = target.config.num_hidden_layers
    for r in res:
        with torch.no_grad():
            o = target(r["tokens"][None], output_hidden_states=True)
        hs = o.hidden_states
        want = torch.cat([hs[i] for i in D.aux_layer_ids(L)], -1)[0, :-1]
        assert r["features"].shape == (r["tokens"].numel() - 1, 3 * 32)
        torch.testing.assert_close(r["features"].float(), want, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(r["final_hidden"].float(), hs[-1][0, :-1], atol=2e-3, rtol=2e-3)
        P = r["prompt_len"]
        # greedy: every generated token is the argmax of the full forward, and is recorded
        assert torch.equal(o.logits[0, P - 1:-1].argmax(-1), r["tokens"][P:])
        assert torch.equal(r["target_argmax"][P - 1:], r["tokens"][P:])
        assert bool((r["target_argmax"][:P - 1] == -1).all())


def test_shard_roundtrip(tmp_path, target):
    data = make_data(tmp_path, target, n_shards=1, per_shard=5)
    path = D.list_shards(data)[0]
    seqs = D.read_shard(path)
    assert len(seqs) == 5
    # write them again and compare field by field
    D.write_shard(tmp_path / "copy.safetensors", seqs)
    again = D.read_shard(tmp_path / "copy.safetensors")
    for a, b in zip(seqs, again):
        assert a.prompt_id == b.prompt_id and a.prompt_len == b.prompt_len
        assert a.sampled == b.sampled and a.finished == b.finished
        assert torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.features, b.features) and torch.equal(a.final_hidden, b.final_hidden)
        assert torch.equal(a.target_argmax, b.target_argmax)
        assert a.features.dtype == torch.float16 and a.features.shape[0] == a.tokens.numel() - 1
    assert not list(tmp_path.glob("**/*.tmp*"))  # atomic writes leave nothing behind
    with pytest.raises(ValueError):
        bad = D.Sequence_("x", torch.arange(5), 2, torch.zeros(5, 96), torch.zeros(4, 32))
        D.write_shard(tmp_path / "bad.safetensors", [bad])


def test_vocab_maps_and_build(tmp_path, target):
    kept = torch.tensor([40, 3, 17, 95, 2])
    d2t, t2d = T.vocab_maps(kept, VOCAB)
    ks = kept.sort().values
    assert torch.equal(torch.arange(5) + d2t, ks)            # target = draft + d2t[draft]
    assert int(t2d.sum()) == 5 and bool(t2d[ks].all())
    data = make_data(tmp_path, target, n_shards=2, per_shard=6)
    info = T.build_vocab(data, 16)
    kept = torch.tensor(info["kept"])
    assert kept.numel() == 16 and torch.equal(kept, kept.sort().values)
    counts = T.token_counts(data, VOCAB)
    # the kept ids are the 16 most frequent response tokens
    assert counts[kept].min() >= counts[~torch.isin(torch.arange(VOCAB), kept)].max()
    assert 0 < info["coverage"]["16"]["train"] <= 1
    # the draft built on the vocab maps draft ids back to exactly those target ids
    draft = T.new_draft(target, kept)
    assert torch.equal(draft.to_target_ids(torch.arange(16)), kept)
    assert torch.equal(draft.t2d.nonzero().squeeze(-1), kept)
    # lm_head initialised from the target's tied embedding rows, fc = identity on the high tap
    torch.testing.assert_close(draft.lm_head.weight, target.get_input_embeddings().weight[kept])
    torch.testing.assert_close(draft.fc.weight[:, 64:], torch.eye(32))


def _trainer(tmp_path, target, data, **kw):
    # float32 unless a test asks otherwise: the same arithmetic on every CPU
    kw.setdefault("amp", "float32")
    kw.setdefault("taps_dtype", "float32")
    cfg = T.TrainConfig(data_dir=str(data), run_dir=str(tmp_path / "run"), vocab_size=32,
                        steps=kw.pop("steps", 30), batch_tokens=64, ttt_steps=2, lr=3e-3, warmup=2,
                        val_seqs=4, eval_every=0, ckpt_every=1000, group_shards=1, **kw)
    return T.Trainer(cfg, target=target, log=lambda *a: None)


def test_loss_decreases(tmp_path, target):
    data = make_data(tmp_path, target, n_shards=2, per_shard=8, max_new=16)
    tr = _trainer(tmp_path, target, data, freeze_lm_head=False)
    batch = tr.stream.next_batch()
    kls, losses = [], []
    for _ in range(30):  # overfit one batch
        m = tr.train_step(batch)
        kls.append(sum(m["kl"]))
        losses.append(m["total"])
    assert losses[-1] < losses[0] and kls[-1] < 0.5 * kls[0], (losses[::5], kls[::5])
    # where a step's time goes (the training log keeps it per step)
    assert set(m["phase_s"]) == {"taps", "forward_loss", "backward_step"}
    assert all(v >= 0 for v in m["phase_s"].values()) and m["phase_s"]["forward_loss"] > 0


def test_batch_moves_every_tensor_and_keeps_missing_taps():
    b = T.Batch(torch.zeros(2, 3, dtype=torch.long), None, None, torch.full((2, 3), -1), torch.ones(2, 3),
                torch.tensor([3, 2]), torch.tensor([1, 1]))
    m = b.to("meta")
    assert m.features is None and m.final_hidden is None
    assert all(getattr(m, f).device.type == "meta"
               for f in ("input_ids", "target_argmax", "attention_mask", "lengths", "prompt_lens"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_training_steps_on_cuda_follow_the_cpu(tmp_path, target):
    """Train steps with the draft (and the taps' target) on the GPU take the CPU's steps: same
    losses, same weights, within float32 reduction-order noise."""
    data = make_data(tmp_path, target, n_shards=2, per_shard=6)
    cpu = _trainer(tmp_path / "cpu", target, data)
    import copy
    gpu = _trainer(tmp_path / "gpu", copy.deepcopy(target), data, device="cuda")
    assert gpu.device.type == "cuda" and next(gpu.draft.parameters()).is_cuda
    for _ in range(3):
        ma = cpu.train_step(cpu.stream.next_batch())
        mb = gpu.train_step(gpu.stream.next_batch())
        assert mb["total"] == pytest.approx(ma["total"], rel=2e-3, abs=1e-4)
    for k, v in cpu.draft.state_dict().items():
        torch.testing.assert_close(gpu.draft.state_dict()[k].cpu(), v, rtol=2e-3, atol=2e-4)
    gpu.save_checkpoint()
    resumed = _trainer(tmp_path / "gpu", copy.deepcopy(target), data, device="cuda")
    assert resumed.step == 3
    ev = gpu.evaluate(ttt_steps=2)
    assert all(math.isfinite(x) for x in ev["loss"] if x == x)


def test_resume_reproduces_state(tmp_path, target):
    data = make_data(tmp_path, target, n_shards=3, per_shard=6)
    a = _trainer(tmp_path / "a", target, data)
    for _ in range(3):
        a.train_step(a.stream.next_batch())
    a.save_checkpoint()
    b = _trainer(tmp_path / "a", target, data)  # same run dir: resumes
    assert b.step == 3 and b.stream.state == a.stream.state
    for k, v in a.draft.state_dict().items():
        assert torch.equal(v, b.draft.state_dict()[k]), k
    # the next steps are identical too (same data position, same optimizer state)
    for _ in range(3):
        ba, bb = a.stream.next_batch(), b.stream.next_batch()
        assert torch.equal(ba.input_ids, bb.input_ids)
        ma, mb = a.train_step(ba), b.train_step(bb)
        assert ma["total"] == pytest.approx(mb["total"], rel=1e-6, abs=1e-7)
    for k, v in a.draft.state_dict().items():
        torch.testing.assert_close(v, b.draft.state_dict()[k], rtol=1e-6, atol=1e-7)


def test_stream_covers_epoch_and_growth(tmp_path, target):
    data = make_data(tmp_path, target, n_shards=2, per_shard=6)
    s = T.DataStream(data, batch_tokens=64, group_shards=1, seed=1)
    seen_ids = set()
    while s.state["epoch"] == 0:
        b = s.next_batch()
        seen_ids.update(map(tuple, b.input_ids.tolist()))
        if s.state["epoch"] == 0 and len(s.state["seen"]) == 2 and s.state["batch"] >= len(s._batches):
            break
    assert s.state["epoch"] == 0 and s.state["batch"] >= len(s._batches)   # epoch 0 used up, not over
    n_train = sum(1 for p in D.list_shards(data) for q in D.read_shard(p) if not T.is_val(q.prompt_id))
    assert len(seen_ids) >= n_train - 1  # identical padded rows could collide, nothing else
    # a shard appearing later joins the current epoch
    (tmp_path / "more").mkdir()
    make_data(tmp_path / "more", target, n_shards=1, per_shard=4, seed=5)
    (tmp_path / "more" / "distill" / "shard_00000.safetensors").rename(data / "shard_00009.safetensors")
    late = {tuple(q.tokens.tolist()) for q in D.read_shard(data / "shard_00009.safetensors")
            if not T.is_val(q.prompt_id)}
    b = s.next_batch()     # epoch 0's two shards are used up: the next group is the new shard, same epoch
    assert s.state["epoch"] == 0 and s.state["group"] == ["shard_00009.safetensors"]
    assert s.state["seen"] == sorted(p.name for p in D.list_shards(data))
    rows = {tuple(r[:n].tolist()) for r, n in zip(b.input_ids, b.lengths.tolist())}
    assert rows and rows <= late, "the first batch after the new shard appeared is not from it"


def test_simulate_and_export(tmp_path, target):
    data = make_data(tmp_path, target, n_shards=2, per_shard=6, max_new=16)
    tr = _trainer(tmp_path, target, data)
    seqs = [q for p in D.list_shards(data) for q in D.read_shard(p) if not q.sampled][:3]
    chain = T.simulate_acceptance(tr.draft, seqs, top_k=1, depth=3, nodes=3)
    tree = T.simulate_acceptance(tr.draft, seqs, top_k=3, depth=3, nodes=8)
    assert 1.0 <= chain["tau"] <= 4.0 and 1.0 <= tree["tau"] <= 4.0
    assert sum(chain["accept_hist"]) == chain["rounds"]
    ck = tr.save_checkpoint()
    dest = T.export_draft(ck, tmp_path / "export", target=target)
    from safetensors import safe_open

    with safe_open(str(dest / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.float16
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert {"fc.weight", "lm_head.weight", "norm.weight", "d2t", "t2d",
            "midlayer.self_attn.q_proj.weight"} <= keys
    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 32 and cfg["vocab_size"] == VOCAB
    info = json.loads((dest / "training_info.json").read_text())
    assert info["ttt_steps"] == 2 and info["ttt_history"] == [[0, 2]]
    [[first, machine]] = info["machines"]                 # where it trained (issue 11 asks)
    assert first == 0 and machine["device"] == "cpu" and machine["threads"] == tr.cfg.threads
    assert machine["torch"] == torch.__version__ and "cpu_flags" in machine
    assert info["data"]["response_tokens"] > 0 and info["data"]["shards"] == 2
    assert all(v["licence"] for v in info["data"]["sources"].values())
    # re-export over a larger vocabulary (frozen lm_head = the target's rows)
    T.build_vocab(data, 48, out=tmp_path / "v48.json")
    dest2 = T.export_draft(ck, tmp_path / "export48", target=target, vocab_file=tmp_path / "v48.json")
    from heterospec.models.draft import Eagle3Draft

    d48 = Eagle3Draft.from_pretrained(dest2, target=target, dtype=torch.float32)
    kept48 = torch.tensor(json.loads((tmp_path / "v48.json").read_text())["kept"])
    assert torch.equal(d48.to_target_ids(torch.arange(48)), kept48)
    torch.testing.assert_close(d48.lm_head.weight, target.get_input_embeddings().weight[kept48].half().float())
    torch.testing.assert_close(d48.fc.weight, tr.draft.fc.weight.half().float())


def test_training_data_info_describes_a_directory_of_linked_shards_per_set(tmp_path, target):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = make_data(tmp_path / "a", target, n_shards=3, per_shard=4, seed=1)
    b = make_data(tmp_path / "b", target, n_shards=2, per_shard=4, seed=2)
    mix = tmp_path / "mix"
    mix.mkdir()
    for i, p in enumerate([D.list_shards(a)[0], D.list_shards(a)[2]] + D.list_shards(b)):
        (mix / f"shard_{i:05d}.safetensors").symlink_to(p)
    info = T.training_data_info(mix)
    one_a, one_b = T.training_data_info(a), T.training_data_info(b)
    assert [m["dir_name"] for m in info["mix"]] == ["distill", "distill"]
    assert [m["shards_used"] for m in info["mix"]] == [["shard_00000.safetensors", "shard_00002.safetensors"],
                                                       ["shard_00000.safetensors", "shard_00001.safetensors"]]
    assert [m["shards_in_set"] for m in info["mix"]] == [3, 2] and info["shards"] == 4
    assert info["mix"][1]["response_tokens"] == one_b["response_tokens"]
    assert 0 < info["mix"][0]["response_tokens"] < one_a["response_tokens"]
    assert info["response_tokens"] == sum(m["response_tokens"] for m in info["mix"])
    # a shard whose set has no manifest: nothing is claimed about the data
    (a / "manifest.json").unlink()
    assert T.training_data_info(mix) is None and T.training_data_info(tmp_path / "gone") is None


def test_a_stopped_and_continued_step_does_not_spend_the_time_budget(tmp_path, target, monkeypatch):
    data = make_data(tmp_path, target, n_shards=2, per_shard=6)
    tr = _trainer(tmp_path, target, data)
    for _ in range(3):
        tr.train_step(tr.stream.next_batch())
    typical, before = tr.typical_step_s, tr.train_seconds
    assert typical > 0
    clock = iter([100.0, 100.0 + 3600.0])      # the step "took" an hour: it was stopped
    monkeypatch.setattr(T.time, "time", lambda: next(clock))
    tr.resumed_from_stop = True                 # what the SIGCONT handler sets
    tr.train_step(tr.stream.next_batch())
    assert tr.train_seconds - before == pytest.approx(typical) and not tr.resumed_from_stop


def test_stop_at_ends_training_at_a_wall_clock_time_with_a_checkpoint_and_evaluation(tmp_path, target,
                                                                                      monkeypatch):
    # a lease's deadline: no step starts after stop_at, yet the run checkpoints and evaluates as
    # at its end (the export that follows needs both)
    data = make_data(tmp_path, target, n_shards=2, per_shard=6)
    now = [1000.0]
    monkeypatch.setattr(T.time, "time", lambda: now[0])
    real_step = T.Trainer.train_step

    def step_and_tick(self, batch):     # every step "takes" 10 s of wall time
        now[0] += 10.0
        return real_step(self, batch)

    monkeypatch.setattr(T.Trainer, "train_step", step_and_tick)
    tr = _trainer(tmp_path / "a", target, data, steps=30, stop_at=1025.0)
    final = tr.fit()
    assert tr.step == 3                          # steps began at 1000, 1010 and 1020, none at 1030
    assert final["step"] == 3 and "loss" in final and (tmp_path / "a" / "run" / "ckpt_latest.pt").exists()
    assert (tmp_path / "a" / "run" / "ckpt_best.pt").exists()
    late = _trainer(tmp_path / "b", target, data, steps=30, stop_at=now[0] - 1)
    late.fit()
    assert late.step == 0


def test_warm_start_from_exported_draft_and_checkpoint(tmp_path, target):
    data = make_data(tmp_path, target, n_shards=2, per_shard=6, max_new=16)
    a = _trainer(tmp_path / "a", target, data)
    for _ in range(3):
        a.train_step(a.stream.next_batch())
    ck = a.save_checkpoint()
    T.build_vocab(data, 24, out=tmp_path / "v24.json")
    exported = T.export_draft(ck, tmp_path / "export", target=target, vocab_file=tmp_path / "v24.json")
    for src, exact in ((exported, False), (ck, True)):
        b = _trainer(tmp_path / f"b-{exact}", target, data, init_from=str(src))
        assert b.step == 0      # a new run: fresh optimizer and schedule, earlier weights
        tol = {} if exact else {"rtol": 1e-3, "atol": 1e-3}   # the export is fp16
        for k in ("fc.weight", "norm.weight", "midlayer.self_attn.q_proj.weight"):
            torch.testing.assert_close(b.draft.state_dict()[k], a.draft.state_dict()[k], **tol)
        kept = b.draft.to_target_ids(torch.arange(32))   # the run's own vocabulary, head = target rows
        torch.testing.assert_close(b.draft.lm_head.weight, target.get_input_embeddings().weight[kept])
        # training_info says what the run started from and how that was trained (lineage)
        b.train_step(b.stream.next_batch())
        dest = T.export_draft(b.save_checkpoint("ckpt_lineage.pt"), tmp_path / f"exp-b-{exact}", target=target)
        info = json.loads((dest / "training_info.json").read_text())
        warm = info["warm_start"]
        assert warm["from"] == str(src) and warm["step"] == 3 and warm["ttt_steps"] == a.cfg.ttt_steps
        assert warm["tokens_seen_lineage"] == a.tokens_seen > 0 and warm["machines"] == a.machines
        assert info["tokens_seen_lineage"] == a.tokens_seen + b.tokens_seen
    # a resumed run keeps its own weights, whatever --init says
    b = _trainer(tmp_path / "b-True", target, data, init_from=str(ck))
    b.train_step(b.stream.next_batch())
    b.save_checkpoint()
    c = _trainer(tmp_path / "b-True", target, data, init_from=str(exported))
    assert c.step == 1 and c.warm_start_from["from"] == str(ck)      # kept by the checkpoint
    for k, v in b.draft.state_dict().items():
        assert torch.equal(v, c.draft.state_dict()[k]), k
    with pytest.raises(FileNotFoundError, match="warm start"):
        _trainer(tmp_path / "c", target, data, init_from=str(tmp_path / "nope"))


def test_a_trained_lm_head_trains_travels_with_warm_start_and_guards_resume(tmp_path, target):
    data = make_data(tmp_path, target, n_shards=2, per_shard=6, max_new=16)
    a = _trainer(tmp_path / "a", target, data, freeze_lm_head=False)
    before = a.draft.lm_head.weight.detach().clone()
    for _ in range(3):
        a.train_step(a.stream.next_batch())
    assert not torch.allclose(a.draft.lm_head.weight, before, rtol=2e-3, atol=2e-3)
    ck = a.save_checkpoint()
    exported = T.export_draft(ck, tmp_path / "export", target=target,
                              vocab_file=tmp_path / "a" / "run" / "vocab.json")
    # same vocabulary: the trained head comes along (fp16 in the export), frozen run or not
    for src, tol in ((ck, {}), (exported, {"rtol": 1e-3, "atol": 1e-3})):
        for frozen in (True, False):
            b = _trainer(tmp_path / f"b-{frozen}-{tol != {}}", target, data, init_from=str(src),
                         freeze_lm_head=frozen)
            torch.testing.assert_close(b.draft.lm_head.weight, a.draft.lm_head.weight, **tol)
            assert b.draft.lm_head.weight.requires_grad is not frozen
    # a frozen head never moves, and warm starts from it keep the target's exact rows
    f = _trainer(tmp_path / "f", target, data)
    head = f.draft.lm_head.weight.detach().clone()
    f.train_step(f.stream.next_batch())
    assert torch.equal(f.draft.lm_head.weight, head)
    g = _trainer(tmp_path / "g", target, data, init_from=str(f.save_checkpoint()), freeze_lm_head=False)
    assert torch.equal(g.draft.lm_head.weight, head)
    # resuming with the other head setting is refused by name, not by AdamW's group mismatch
    with pytest.raises(ValueError, match="lm_head trained.*with --train-lm-head"):
        _trainer(tmp_path / "a", target, data)
    with pytest.raises(ValueError, match="lm_head frozen.*without --train-lm-head"):
        _trainer(tmp_path / "f", target, data, freeze_lm_head=False)


def test_a_wider_mlp_starts_as_the_draft_it_widens_and_keeps_its_width(tmp_path, target):
    """--intermediate-size N: the warm start's MLP units are copied into the first ones and the
    new ones start silent, so the wider draft is the same function at step 0 and then learns."""
    data = make_data(tmp_path, target, n_shards=2, per_shard=6, max_new=16)
    a = _trainer(tmp_path / "a", target, data)
    for _ in range(2):
        a.train_step(a.stream.next_batch())
    ck = a.save_checkpoint()
    n, wide = target.config.intermediate_size, 160
    b = _trainer(tmp_path / "b", target, data, init_from=str(ck), intermediate_size=wide)
    assert b.draft.config.intermediate_size == wide and b.cfg.intermediate_size == wide
    batch = b.stream.next_batch()
    with torch.no_grad():
        out_a = a.draft.forward_train(batch.input_ids, batch.features, batch.attention_mask, ttt_steps=2,
                                      return_logits=False)
        out_b = b.draft.forward_train(batch.input_ids, batch.features, batch.attention_mask, ttt_steps=2,
                                      return_logits=False)
    for ha, hb in zip(out_a.hidden, out_b.hidden):
        torch.testing.assert_close(hb, ha, rtol=1e-5, atol=1e-5)
    mlp = b.draft.midlayer.mlp
    assert torch.equal(mlp.gate_proj.weight[:n], a.draft.midlayer.mlp.gate_proj.weight)
    assert bool((mlp.down_proj.weight[:, n:] == 0).all()) and bool((mlp.gate_proj.weight[n:] != 0).any())
    b.train_step(batch)
    assert bool((mlp.down_proj.weight[:, n:] != 0).any())          # the new units learn
    b_ck = b.save_checkpoint()
    # a resumed run keeps its width; asking for another one is refused by name
    assert _trainer(tmp_path / "b", target, data).draft.config.intermediate_size == wide
    with pytest.raises(ValueError, match=f"MLP {wide} wide"):
        _trainer(tmp_path / "b", target, data, intermediate_size=n)
    # the export says its width; a warm start from it (or from the checkpoint) keeps it
    exported = T.export_draft(b_ck, tmp_path / "export", target=target)
    assert json.loads((exported / "config.json").read_text())["intermediate_size"] == wide
    assert T.load_draft(exported, target).config.intermediate_size == wide
    assert T.load_draft(b_ck, target).config.intermediate_size == wide
    for src in (exported, b_ck):
        c = _trainer(tmp_path / f"c-{src.name}", target, data, init_from=str(src))
        assert c.draft.config.intermediate_size == wide
    with pytest.raises(ValueError, match="narrower"):
        _trainer(tmp_path / "d", target, data, init_from=str(b_ck), intermediate_size=n)
    # a new draft's layer from a target layer: the target's MLP fills the first units
    e = _trainer(tmp_path / "e", target, data, init_layer=-3, intermediate_size=wide)
    src = target.model.layers[target.config.num_hidden_layers - 3].mlp
    assert torch.equal(e.draft.midlayer.mlp.up_proj.weight[:n], src.up_proj.weight)
    assert torch.equal(e.draft.midlayer.mlp.down_proj.weight[:, :n], src.down_proj.weight)
    assert bool((e.draft.midlayer.mlp.down_proj.weight[:, n:] == 0).all())
    from heterospec.train.cli import build_parser

    assert build_parser().parse_args(["train", "--intermediate-size", "3072"]).intermediate_size == 3072


def test_lr_schedule_warms_up_then_decays_to_min_lr_ratio():
    cfg = T.TrainConfig(data_dir="d", run_dir="r", steps=110, lr=1e-3, warmup=10)
    assert T.lr_at(cfg, 0) == pytest.approx(1e-4) and T.lr_at(cfg, 9) == pytest.approx(1e-3)
    assert T.lr_at(cfg, 10) == pytest.approx(1e-3) and T.lr_at(cfg, 110) == pytest.approx(1e-4)
    assert T.lr_at(cfg, 60) == pytest.approx(0.55e-3)          # halfway down the cosine
    const = T.TrainConfig(data_dir="d", run_dir="r", steps=110, lr=1e-3, warmup=10, min_lr_ratio=1.0)
    assert {round(T.lr_at(const, s), 12) for s in range(9, 200)} == {1e-3}
    from heterospec.train.cli import build_parser

    args = build_parser().parse_args(["train", "--min-lr-ratio", "1"])
    assert args.min_lr_ratio == 1.0


def test_init_layer_copies_a_target_layer_into_a_new_draft_only(tmp_path, target):
    data = make_data(tmp_path, target, n_shards=2, per_shard=6, max_new=16)
    plain = _trainer(tmp_path / "plain", target, data)
    a = _trainer(tmp_path / "a", target, data, init_layer=-3)
    L, H = target.config.num_hidden_layers, target.config.hidden_size
    src, dst = target.model.layers[L - 3], a.draft.midlayer
    for n in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(dst.mlp, n).weight, getattr(src.mlp, n).weight), n
    assert torch.equal(dst.self_attn.o_proj.weight, src.self_attn.o_proj.weight)
    for n in ("q_proj", "k_proj", "v_proj"):   # g half = the target's; embedding half 0.1 x random
        w, w0 = getattr(dst.self_attn, n).weight, getattr(plain.draft.midlayer.self_attn, n).weight
        assert torch.equal(w[:, H:], getattr(src.self_attn, n).weight), n
        torch.testing.assert_close(w[:, :H], 0.1 * w0[:, :H])
    assert torch.equal(dst.hidden_norm.weight, src.input_layernorm.weight)
    assert torch.equal(dst.post_attention_layernorm.weight, src.post_attention_layernorm.weight)
    for k in ("fc.weight", "norm.weight", "lm_head.weight"):    # the rest of new_draft's init
        assert torch.equal(a.draft.state_dict()[k], plain.draft.state_dict()[k]), k
    a.train_step(a.stream.next_batch())
    a.save_checkpoint()
    b = _trainer(tmp_path / "a", target, data, init_layer=0)   # a resumed run keeps its weights
    for k, v in a.draft.state_dict().items():
        assert torch.equal(v, b.draft.state_dict()[k]), k
    with pytest.raises(ValueError, match="outside the target's"):
        _trainer(tmp_path / "c", target, data, init_layer=L)
    with pytest.raises(ValueError, match="give one of them"):
        _trainer(tmp_path / "d", target, data, init_layer=-1,
                 init_from=str(tmp_path / "a" / "run" / "ckpt_latest.pt"))


def test_training_prompts_disjoint_from_benchmarks():
    from heterospec import datasets as DS
    from heterospec.train import prompts as TP

    # the stdlib code source parses ~14 MB of source: use a subset of files here
    code = TP._code_prompts(60, random.Random(0), max_files=120)
    train = TP.build_training_prompts(300, seed=0, mix={"instruct": 0.5, "docs": 0.2, "math": 0.3})
    assert len(train) >= 250 and len(code) == 60
    train += code
    texts = {p.text for p in train}
    for name in ("mtbench", "humaneval", "alpaca"):
        try:
            bench = DS.load_prompts(name)
        except DS.MissingDataError:
            continue
        assert not texts & {p.text for p in bench}, name
    try:
        root = DS.doc_sources_root()
    except DS.MissingDataError:
        return
    cnn = DS.load_prompts("cnndm", n=50)
    files = {p.id.split("/", 1)[1].rsplit("#", 1)[0] for p in cnn}
    assert all(DS.doc_split(f) == "eval" for f in files)
    train_files = {rel for rel, _, _ in TP.train_doc_passages()}
    assert not files & train_files
    assert all(DS.doc_split(f) == "train" for f in train_files)


def test_chain_simulation_matches_training_time_test(tmp_path, target):
    """The offline chain simulation (extend + tree_step, as in decoding) accepts exactly what the
    training-time-test unroll predicts at the same roots: both see the same inputs/attention."""
    data = make_data(tmp_path, target, n_shards=1, per_shard=6, max_new=16)
    tr = _trainer(tmp_path, target, data)
    for _ in range(5):  # a few steps so the draft is not uniform noise
        tr.train_step(tr.stream.next_batch())
    draft = tr.draft.eval()
    depth = 3
    seqs = [q for q in D.read_shard(D.list_shards(data)[0]) if not q.sampled][:3]
    total_acc = rounds = 0
    with torch.no_grad():
        for q in seqs:
            toks = q.tokens
            n = toks.numel()
            feats = torch.cat([q.features.float(), torch.zeros(1, q.features.shape[1])])  # n rows
            out = draft.forward_train(toks[None], feats[None], ttt_steps=depth, return_logits=True)
            pred = [draft.to_target_ids(l[0].argmax(-1)) for l in out.logits]  # [S] per step
            root = q.prompt_len
            while root < n - 1:
                acc = 0
                while acc < depth and root + acc + 1 < n and int(pred[acc][root - 1]) == int(toks[root + acc + 1]):
                    acc += 1
                total_acc += acc
                rounds += 1
                root += acc + 1
    want = 1.0 + total_acc / rounds
    got = T.simulate_acceptance(draft, seqs, top_k=1, depth=depth, nodes=depth)
    assert got["rounds"] == rounds
    assert got["tau"] == pytest.approx(want)


# ----------------------------------------------------------------------------- token-only shards


def test_token_only_shard_keeps_everything_but_the_taps(tmp_path, target):
    data = make_data(tmp_path, target, n_shards=1, per_shard=6, max_new=12)
    path = D.list_shards(data)[0]
    seqs = D.read_shard(path)
    assert any(q.sampled for q in seqs)
    # a sampled row whose argmax differs from the drawn token: the exceptions must carry it
    assert any(bool((q.target_argmax[q.prompt_len - 1:] != q.tokens[q.prompt_len:]).any())
               for q in seqs if q.sampled)
    D.write_shard(tmp_path / "tok.safetensors", seqs, taps=False)
    sh = D.DistillShard(tmp_path / "tok.safetensors")
    assert not sh.has_taps and D.DistillShard(path).has_taps
    from safetensors import safe_open

    with safe_open(str(tmp_path / "tok.safetensors"), "pt") as f:
        assert f.get_tensor("tokens").dtype == torch.uint16
        assert "features" not in f.keys() and f.metadata()["format"] == D.TOKENS_ONLY_FORMAT
    for a, b in zip(seqs, sh):
        assert (a.prompt_id, a.prompt_len, a.sampled, a.finished) == (b.prompt_id, b.prompt_len,
                                                                      b.sampled, b.finished)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.target_argmax, b.target_argmax)
        assert b.features is None and b.final_hidden is None
    assert (tmp_path / "tok.safetensors").stat().st_size * 20 < path.stat().st_size
    # token ids beyond uint16 are stored as int32, not wrapped
    big = D.Sequence_("big", torch.tensor([1, 70000, 5]), 1, None, None,
                      target_argmax=torch.tensor([70000, 5]))
    D.write_shard(tmp_path / "big.safetensors", [big], taps=False)
    back = D.read_shard(tmp_path / "big.safetensors")[0]
    assert back.tokens.tolist() == [1, 70000, 5] and back.target_argmax.tolist() == [70000, 5]


class _CharTokenizer:
    """Just enough of a tokenizer for run_distill: a chat template of BOS + one id per char."""

    eos_token_id = pad_token_id = EOS
    unk_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [1] + [3 + ord(c) % (VOCAB - 3) for c in messages[-1]["content"]]

    def convert_tokens_to_ids(self, token):
        return None


def test_token_only_distill_run_writes_greedy_answers(tmp_path, target):
    """run_distill with store_taps=False (the GPU lease's --no-taps) writes token-only shards
    whose greedy answers are the target's."""
    from heterospec.train.prompts import Prompt

    prompts = [Prompt(id=f"q{i}", text="ab" * (i + 1), source="test") for i in range(5)]
    cfg = D.DistillConfig(out_dir=str(tmp_path / "out"), num_prompts=5, shard_size=2,
                          max_new_tokens=6, sampled_fraction=0.0, disjoint=False,
                          store_taps=False, device="cpu", dtype="float32")
    summary = D.run_distill(cfg, model=target, tokenizer=_CharTokenizer(), prompts=prompts,
                            log=lambda *a: None)
    assert summary["shards"] == 3 and summary["planned"] == 3
    seen = 0
    for path in D.list_shards(tmp_path / "out"):
        shard = D.DistillShard(path)
        assert not shard.has_taps
        for q in shard:
            seen += 1
            with torch.no_grad():
                logits = target(q.tokens[None]).logits[0]
            P = q.prompt_len
            assert torch.equal(logits[P - 1:-1].argmax(-1), q.tokens[P:])
            assert torch.equal(q.target_argmax[P - 1:], q.tokens[P:])
    assert seen == 5


def test_recomputed_taps_match_generation(tmp_path, target):
    data = make_data(tmp_path, target, n_shards=1, per_shard=5, max_new=10)
    seqs = D.read_shard(D.list_shards(data)[0])
    stored = T.collate(seqs)
    D.write_shard(tmp_path / "tok.safetensors", seqs, taps=False)
    bare = T.collate(D.read_shard(tmp_path / "tok.safetensors"))
    assert bare.features is None and torch.equal(bare.target_argmax, stored.target_argmax)
    full = T.with_taps(bare, target)
    # fp16 storage of the generated taps vs a float32 teacher-forced pass
    torch.testing.assert_close(full.features, stored.features, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(full.final_hidden, stored.final_hidden, atol=3e-3, rtol=3e-3)
    assert T.with_taps(stored, target) is stored
    one = T.sequences_with_taps([D.read_shard(tmp_path / "tok.safetensors")[0]], target)[0]
    torch.testing.assert_close(one.features.float(), seqs[0].features.float(), atol=3e-3, rtol=3e-3)
    assert one.features.shape[0] == one.tokens.numel() - 1


def test_pack_resumes_and_refuses_other_data(tmp_path, target):
    data = make_data(tmp_path, target, n_shards=2, per_shard=4)
    man = {"num_layers": 6, "hidden_size": 32, "vocab_size": VOCAB, "aux_layers": [2, 3, 3],
           "config": {"seed": 0}, "prompt_list_sha256": "abc"}
    (data / "manifest.json").write_text(json.dumps(man))
    dst = tmp_path / "packed"
    first = D.list_shards(data)[0]
    (tmp_path / "hold").mkdir()
    held = first.rename(tmp_path / "hold" / first.name)   # only the second shard exists yet
    assert D.pack_shards(data, dst, log=lambda *a: None)["packed"] == 1
    held.rename(first)
    assert D.pack_shards(data, dst, log=lambda *a: None) == {
        "packed": 1, "response_tokens": D.DistillShard(first).num_response_tokens, "shards": 2}
    assert json.loads((dst / "manifest.json").read_text()) == man
    for p in D.list_shards(data):
        for a, b in zip(D.read_shard(p), D.read_shard(dst / p.name)):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.target_argmax, b.target_argmax)
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps(dict(man, prompt_list_sha256="xyz")))
    with pytest.raises(ValueError, match="prompt_list_sha256"):
        D.pack_shards(data, other, log=lambda *a: None)
    with pytest.raises(FileNotFoundError, match="manifest"):
        D.pack_shards(tmp_path / "hold", tmp_path / "x", log=lambda *a: None)


def test_training_on_packed_shards_equals_training_on_stored_taps(tmp_path, target):
    data = make_data(tmp_path, target, n_shards=2, per_shard=6, max_new=12)
    (data / "manifest.json").write_text(json.dumps({"vocab_size": VOCAB, "num_layers": 6,
                                                    "hidden_size": 32, "config": {}}))
    packed = tmp_path / "packed"
    D.pack_shards(data, packed, log=lambda *a: None)
    a = _trainer(tmp_path / "a", target, data)
    b = _trainer(tmp_path / "b", target, packed)
    assert a.val_refs == b.val_refs
    for _ in range(4):
        ba, bb = a.stream.next_batch(), b.stream.next_batch()
        assert torch.equal(ba.input_ids, bb.input_ids) and bb.features is None
        ma, mb = a.train_step(ba), b.train_step(bb)
        assert mb["total"] == pytest.approx(ma["total"], rel=2e-3)
    ea, eb = a.evaluate(), b.evaluate()
    assert eb["n"] == ea["n"]
    assert eb["loss"][0] == pytest.approx(ea["loss"][0], rel=5e-3)
    assert b.simulate(seqs=2)["rounds"] == a.simulate(seqs=2)["rounds"]


def test_bfloat16_autocast_trains_like_float32(tmp_path, target):
    data = make_data(tmp_path, target, n_shards=2, per_shard=8, max_new=16)
    f32 = _trainer(tmp_path / "f", target, data, freeze_lm_head=False)
    bf = _trainer(tmp_path / "b", target, data, freeze_lm_head=False, amp="bfloat16")
    batch = f32.stream.next_batch()
    m32, mbf = f32.train_step(batch), bf.train_step(batch)
    assert mbf["total"] == pytest.approx(m32["total"], rel=3e-2)
    losses = [mbf["total"]] + [bf.train_step(batch)["total"] for _ in range(20)]
    assert losses[-1] < 0.8 * losses[0], losses[::5]
    # the weights and the optimizer stay float32
    assert all(p.dtype == torch.float32 for p in bf.draft.parameters())


def test_distill_skips_prompts_another_set_answered(tmp_path, target):
    """--skip-answered: a plan begun elsewhere (its shards here) is not answered twice, and the
    run resumes with the same setting (the manifest keeps it as JSON does)."""
    from heterospec.train.prompts import Prompt

    prompts = [Prompt(id=f"q{i}", text="ab" * (i + 1), source="test") for i in range(6)]
    first = D.DistillConfig(out_dir=str(tmp_path / "a"), num_prompts=6, shard_size=2,
                            max_new_tokens=3, disjoint=False, store_taps=False, device="cpu",
                            dtype="float32", max_shards=1)
    D.run_distill(first, model=target, tokenizer=_CharTokenizer(), prompts=prompts, log=lambda *a: None)
    done = {pid for f in D.list_shards(tmp_path / "a") for pid in D.DistillShard(f).prompt_ids}
    assert len(done) == 2
    cfg = D.DistillConfig(out_dir=str(tmp_path / "b"), num_prompts=6, shard_size=2, max_new_tokens=3,
                          disjoint=False, store_taps=False, device="cpu", dtype="float32",
                          skip_answered=(str(tmp_path / "a"),), max_shards=1)
    log = []
    out = D.run_distill(cfg, model=target, tokenizer=_CharTokenizer(), prompts=prompts, log=log.append)
    assert out["planned"] == 2 and any("skip-answered: 2 prompts" in m for m in log)
    out = D.run_distill(cfg, model=target, tokenizer=_CharTokenizer(), prompts=prompts, log=lambda *a: None)
    assert out["shards"] == 2   # resumed under the same manifest
    got = {pid for f in D.list_shards(tmp_path / "b") for pid in D.DistillShard(f).prompt_ids}
    assert len(got) == 4 and not got & done
    assert "skip_answered" not in json.loads((tmp_path / "a" / "manifest.json").read_text())["config"]
    # a directory without shards is named, not taken as "nothing answered"
    empty = D.DistillConfig(out_dir=str(tmp_path / "c"), num_prompts=6, disjoint=False,
                            skip_answered=(str(tmp_path / "nowhere"),), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=r"no distilled shards .*nowhere"):
        D.run_distill(empty, model=target, tokenizer=_CharTokenizer(), prompts=prompts, log=lambda *a: None)
