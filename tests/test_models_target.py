"""TargetModel: parity with transformers, tree verification == sequential decoding, KV compaction,
loading and bad input. Tiny random models (CPU, fast); SmolLM2 tests are marked slow; FlashInfer
tests need CUDA."""

from __future__ import annotations

import json
import os

import pytest
import torch

import heterospec
from heterospec.models import TargetModel
from heterospec.models.attention import flashinfer_available
from models_util import llama3_rope_scaling, path_to, random_parents, tiny_llama

# Tolerances (absolute, on logits of magnitude ~1-10; features likewise)
ATOL = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 0.15}
RTOL = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 0.05}

CONFIGS = {
    # name: tiny_llama kwargs
    "mha_odd_vocab": dict(vocab=97, hidden=48, layers=5, heads=4, kv_heads=4),  # GQA ratio 1
    "gqa3_tied": dict(vocab=131, hidden=48, layers=6, heads=6, kv_heads=2, tied=True),  # ratio 3
    "gqa4_untied": dict(vocab=101, hidden=64, layers=4, heads=8, kv_heads=2),  # ratio 4
    "llama3_rope": dict(vocab=89, hidden=64, layers=6, heads=4, kv_heads=1, rope_theta=500000.0,
                        rope_scaling=llama3_rope_scaling(16), head_dim=32),
    "yarn_rope": dict(vocab=64, hidden=32, layers=4, heads=2, kv_heads=2,  # attention scaling != 1
                      rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}, max_position=32),
    "linear_rope": dict(vocab=70, hidden=32, layers=3, heads=4, kv_heads=2,
                        rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "dynamic_rope": dict(vocab=70, hidden=32, layers=3, heads=4, kv_heads=2, max_position=16,
                         rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "longrope": dict(vocab=70, hidden=32, layers=3, heads=2, kv_heads=1, max_position=64,  # head_dim 16
                     rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 16,
                                   "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                   "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
    # Llama-3.2-style head_dim != hidden / heads, with q/k/v/o and MLP biases (checked non-zero below)
    "biases_head_dim": dict(vocab=70, hidden=32, layers=3, heads=4, kv_heads=2, head_dim=16,
                            attention_bias=True, mlp_bias=True),
}


def _i64(*xs):
    return torch.tensor(xs, dtype=torch.long)


def _close(a, b, dtype=torch.float32):
    torch.testing.assert_close(a, b, atol=ATOL[dtype], rtol=RTOL[dtype])


def _hf_reference(hf, ids):
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    return out.logits.float(), out.hidden_states


# ---------------------------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_matches_transformers(name):
    hf = tiny_llama(seed=1, **CONFIGS[name])
    with torch.no_grad():  # transformers starts biases at zero, which would test nothing
        for pname, p in hf.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, 0.3)
    tm = TargetModel.from_hf(hf)
    B, T = 2, 11
    ids = torch.randint(0, hf.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    ref_logits, hs = _hf_reference(hf, ids)
    cache = tm.new_cache(B, 16)
    logits, feats = tm(ids, torch.arange(T).expand(B, T), cache, _i64(0, 0))
    assert logits.dtype == torch.float32 and logits.shape == (B, T, hf.config.vocab_size)
    _close(logits, ref_logits)
    L = hf.config.num_hidden_layers
    assert tm.config.aux_layers == tuple(min(max(i, 0), L) for i in (2, L // 2, L - 3))
    _close(feats, torch.cat([hs[i] for i in tm.config.aux_layers], dim=-1))
    assert feats.shape == (B, T, 3 * hf.config.hidden_size)
    # the tied model shares one tensor
    if hf.config.tie_word_embeddings:
        assert tm.lm_head.weight is tm.embed_tokens.weight


def test_prefill_then_decode_matches_transformers():
    hf = tiny_llama(seed=2, **CONFIGS["gqa3_tied"])
    tm = TargetModel.from_hf(hf)
    ids = torch.randint(0, 131, (1, 12), generator=torch.Generator().manual_seed(1))
    ref, _ = _hf_reference(hf, ids)
    cache = tm.new_cache(1, 12)
    logits, _ = tm(ids[:, :7], torch.arange(7)[None], cache, _i64(0))
    _close(logits, ref[:, :7])
    for p in range(7, 12):  # one-token decode = a one-node tree
        logits, _ = tm(ids[:, p:p + 1], _i64(p)[None], cache, _i64(p), torch.ones(1, 1, 1, dtype=torch.bool),
                       _i64(1))
        _close(logits[:, 0], ref[:, p])


def test_bf16_smoke():
    hf = tiny_llama(seed=3, dtype=torch.bfloat16, **CONFIGS["gqa4_untied"])
    tm = TargetModel.from_hf(hf)
    assert tm.dtype == torch.bfloat16
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(2))
    ref, hs = _hf_reference(hf, ids)
    cache = tm.new_cache(2, 9)
    assert cache.k.dtype == torch.bfloat16
    logits, feats = tm(ids, torch.arange(9).expand(2, 9), cache, _i64(0, 0))
    assert feats.dtype == torch.bfloat16
    _close(logits, ref, torch.bfloat16)


def test_float64_and_dtype_cast():
    hf = tiny_llama(seed=4, **CONFIGS["mha_odd_vocab"])
    tm = TargetModel.from_hf(hf, dtype=torch.float64)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(3))
    ref, _ = _hf_reference(hf.double(), ids)
    logits, _ = tm(ids, torch.arange(6)[None], tm.new_cache(1, 6), _i64(0))
    _close(logits, ref, torch.float64)


def test_logits_index():
    hf = tiny_llama(seed=5, **CONFIGS["gqa4_untied"])
    tm = TargetModel.from_hf(hf)
    ids = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(4))
    full, _ = tm(ids, torch.arange(7).expand(2, 7), tm.new_cache(2, 8), _i64(0, 0), return_features=False)
    idx = _i64(6, 3)[:, None]
    part, feats = tm(ids, torch.arange(7).expand(2, 7), tm.new_cache(2, 8), _i64(0, 0), return_features=False,
                     logits_index=idx)
    assert feats is None and part.shape == (2, 1, 101)
    _close(part[:, 0], full[torch.arange(2), idx[:, 0]])


# ---------------------------------------------------------------------------------------------
# Tree verification == sequential decoding; compaction


def _sequential(tm, prompt, tokens):
    """Logits and features of decoding `tokens` one at a time after prefilling `prompt` (B = 1)."""
    cache = tm.new_cache(1, len(prompt) + len(tokens))
    tm(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache, _i64(0))
    outs = []
    for j, t in enumerate(tokens):
        p = len(prompt) + j
        outs.append(tm(torch.tensor([[t]]), _i64(p)[None], cache, _i64(p)))
    return torch.cat([o[0][0] for o in outs]), torch.cat([o[1][0] for o in outs])


@pytest.mark.parametrize("name", ["gqa3_tied", "llama3_rope"])
def test_tree_verification_matches_sequential_and_compaction(name):
    hf = tiny_llama(seed=6, **CONFIGS[name])
    V = hf.config.vocab_size
    tm = TargetModel.from_hf(hf)
    gen = torch.Generator().manual_seed(7)
    B, T, S = 3, 9, 40
    prompt_lens = [5, 11, 8]
    num_nodes = _i64(9, 6, 1)  # request 2: a lone root (plain decode) inside a padded batch
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in prompt_lens]

    # batched prefill of prompts of different lengths (padding rows written past each prompt)
    P = max(prompt_lens)
    ids = torch.zeros(B, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    cache = tm.new_cache(B, S)
    logits, _ = tm(ids, torch.arange(P).expand(B, P), cache, _i64(0, 0, 0), num_nodes=torch.tensor(prompt_lens))
    for b, p in enumerate(prompts):
        ref, _ = _hf_reference(hf, torch.tensor([p]))
        _close(logits[b, : len(p)], ref[0])

    # random trees
    prefix = torch.tensor(prompt_lens)
    parents = torch.full((B, T), -1, dtype=torch.long)
    par_lists = []
    for b in range(B):
        n = int(num_nodes[b])
        pl = random_parents(n, gen)
        par_lists.append(pl)
        parents[b, :n] = torch.tensor(pl)
    tree_mask, positions, _, _ = heterospec.build_tree(parents, num_nodes, prefix)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    t_logits, t_feats = tm(tokens, positions, cache, prefix, tree_mask, num_nodes)

    for b in range(B):
        for i in range(int(num_nodes[b])):
            path = path_to(par_lists[b], i)
            s_logits, s_feats = _sequential(tm, prompts[b], tokens[b, path].tolist())
            _close(t_logits[b, i], s_logits[-1])
            _close(t_feats[b, i], s_feats[-1])

    # accept the path to the deepest node of each request, compact, continue with 3 more tokens
    accept_path = torch.full((B, T), -1, dtype=torch.long)
    accept_len = torch.zeros(B, dtype=torch.long)
    accepted = []
    for b in range(B):
        n = int(num_nodes[b])
        deepest = max(range(n), key=lambda i: (len(path_to(par_lists[b], i)), i))
        path = path_to(par_lists[b], deepest)
        accept_path[b, : len(path)] = torch.tensor(path)
        accept_len[b] = len(path) - 1
        accepted.append(tokens[b, path].tolist())
    cache.compact(accept_path, accept_len, prefix)
    new_prefix = prefix + accept_len + 1
    more = torch.randint(0, V, (B, 3), generator=gen)
    pos = new_prefix[:, None] + torch.arange(3)
    c_logits, c_feats = tm(more, pos, cache, new_prefix)
    for b in range(B):
        seq = prompts[b] + accepted[b] + more[b].tolist()
        ref, hs = _hf_reference(hf, torch.tensor([seq]))
        _close(c_logits[b], ref[0, -3:])
        _close(c_feats[b], torch.cat([hs[i][0, -3:] for i in tm.config.aux_layers], dim=-1))


# ---------------------------------------------------------------------------------------------
# Loading from a directory


def test_from_pretrained_sharded_dir_with_tokenizer_absent(tmp_path):
    hf = tiny_llama(seed=8, **CONFIGS["gqa4_untied"])
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [2, 7]}, f)
    tm = TargetModel.from_pretrained(tmp_path)
    assert tm.tokenizer is None and tm.dtype == torch.float32
    assert tm.config.eos_token_ids == (2, 7)
    ids = torch.randint(0, 101, (1, 8), generator=torch.Generator().manual_seed(9))
    ref, _ = _hf_reference(hf, ids)
    logits, _ = tm(ids, torch.arange(8)[None], tm.new_cache(1, 8), _i64(0))
    _close(logits, ref)


def test_from_pretrained_pytorch_model_bin(tmp_path):
    """The older .bin layout: one file, or shards with an index (and the legacy rotary buffers
    some uploads carry); a shard the index names but the directory lacks is named."""
    hf = tiny_llama(seed=10, **CONFIGS["gqa4_untied"])
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    ids = torch.randint(0, 101, (1, 7), generator=torch.Generator().manual_seed(4))
    ref, _ = _hf_reference(hf, ids)
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    for d in (one, sharded):
        hf.config.save_pretrained(d)
    torch.save(sd, one / "pytorch_model.bin")
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)   # legacy key, ignored
    names = sorted(sd)
    weight_map = {}
    for n, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), start=1):
        fn = f"pytorch_model-0000{n}-of-00002.bin"
        torch.save({k: sd[k] for k in part}, sharded / fn)
        weight_map.update({k: fn for k in part})
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for d in (one, sharded):
        tm = TargetModel.from_pretrained(d)
        logits, _ = tm(ids, torch.arange(7)[None], tm.new_cache(1, 7), _i64(0))
        _close(logits, ref)
    (sharded / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(FileNotFoundError, match="pytorch_model-00002-of-00002.bin"):
        TargetModel.from_pretrained(sharded)


@pytest.mark.parametrize("name,limit", [("dynamic_rope", 16), ("longrope", 16)])
def test_length_rescaled_rope_is_capped(name, limit):
    """transformers recomputes dynamic / longrope frequencies from the sequence length, which a
    static cache cannot follow: our logits match it up to that length, and beyond is an error."""
    from heterospec import Engine

    hf = tiny_llama(seed=11, **CONFIGS[name])
    tm = TargetModel.from_hf(hf)
    ids = torch.randint(0, 70, (1, limit), generator=torch.Generator().manual_seed(5))
    ref, _ = _hf_reference(hf, ids)
    logits, _ = tm(ids, torch.arange(limit)[None], tm.new_cache(1, limit), _i64(0))
    _close(logits, ref)
    with pytest.raises(ValueError, match=f"max_length {limit + 1} exceeds {limit}.*{name.split('_')[0]}"):
        tm.new_cache(1, limit + 1)
    assert Engine(tm).max_length == limit           # the default stays inside
    with pytest.raises(ValueError, match="exceeds"):
        Engine(tm, max_length=limit + 8)


def test_rope_table_stays_float32():
    """Casting a model never rounds its RoPE frequencies (bf16 would move the angles of distant
    positions by up to half a radian); devices are still followed."""
    tm = TargetModel.from_hf(tiny_llama(seed=12, **CONFIGS["llama3_rope"]))
    before = tm.rotary.inv_freq.clone()
    tm.to(torch.bfloat16)
    assert tm.dtype == torch.bfloat16 and tm.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(tm.rotary.inv_freq, before)
    tm.to(device="meta")
    assert tm.rotary.inv_freq.device.type == "meta" and tm.rotary.inv_freq.dtype == torch.float32


def test_from_pretrained_tied_dtype(tmp_path):
    hf = tiny_llama(seed=9, **CONFIGS["gqa3_tied"])
    hf.save_pretrained(tmp_path)
    tm = TargetModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert tm.dtype == torch.bfloat16 and tm.lm_head.weight is tm.embed_tokens.weight


# ---------------------------------------------------------------------------------------------
# Bad input


def test_missing_dir_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        TargetModel.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        TargetModel.from_pretrained(tmp_path)
    tiny_llama(**CONFIGS["gqa4_untied"]).config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        TargetModel.from_pretrained(tmp_path)


def test_malformed_json_files_are_named(tmp_path):
    """A config, generation config or shard index that is not a JSON object: a ValueError naming
    the file, not a bare JSONDecodeError (or a KeyError for an index without its weight_map)."""
    hf = tiny_llama(**CONFIGS["gqa4_untied"])
    hf.save_pretrained(tmp_path)
    cfg = tmp_path / "config.json"
    good = cfg.read_text()
    cfg.write_text(good[:-5])
    with pytest.raises(ValueError, match=r"target config .*config.json is not valid JSON"):
        TargetModel.from_pretrained(tmp_path)
    cfg.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json must hold a JSON object, got list"):
        TargetModel.from_pretrained(tmp_path)
    cfg.write_text(good)
    (tmp_path / "generation_config.json").write_text("{eos")
    with pytest.raises(ValueError, match=r"target generation config .*generation_config.json is not valid JSON"):
        TargetModel.from_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="has no weight_map of tensor names to shard files"):
        TargetModel.from_pretrained(tmp_path)


def test_unsupported_architecture(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture: mistral"):
        TargetModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture: mistral"):
        TargetModel.from_hf(MistralForCausalLM(cfg))
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="unsupported architecture: qwen2"):
        TargetModel.from_hf(qwen)


def test_auto_backend_is_sdpa_on_cpu():
    tm = TargetModel.from_hf(tiny_llama(**CONFIGS["gqa4_untied"]))
    assert tm.attn_backend_name == "auto" and tm.backend.name == "sdpa"


def test_missing_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = tiny_llama(**CONFIGS["gqa4_untied"])
    hf.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, f)
    with pytest.raises(KeyError, match="layers.1.mlp.up_proj.weight"):
        TargetModel.from_pretrained(tmp_path)


def test_writing_past_the_cache():
    tm = TargetModel.from_hf(tiny_llama(**CONFIGS["gqa4_untied"]))
    cache = tm.new_cache(2, 8)
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="max_length"):
        tm(ids, torch.arange(5).expand(2, 5), cache, _i64(0, 4))
    with pytest.raises(ValueError, match="max_length"):
        tm(torch.zeros(1, 9, dtype=torch.long), torch.arange(9)[None], tm.new_cache(1, 8), _i64(0))
    with pytest.raises(ValueError, match="tree_mask"):
        tm(ids, torch.arange(5).expand(2, 5), cache, _i64(0, 0), torch.ones(2, 5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="backend"):
        tm.set_attn_backend("nope")
    with pytest.raises(ValueError, match="CUDA"):
        tm.set_attn_backend("flashinfer")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_attention_without_mask_is_bit_identical(dtype):
    """A one-token step of one request attends to every key: the SDPA backend then passes no
    mask, which must give the very bits of the all-True mask (else AR and tree rows could part)."""
    from heterospec.models.attention import SdpaAttention
    from heterospec.models.kv_cache import KVCache
    from heterospec.models.layers import sdpa

    g = torch.Generator().manual_seed(3)
    for W in (1, 7, 64, 257, 1000):
        q, k, v = (torch.randn(1, n, h, 16, generator=g).to(dtype) for n, h in ((1, 6), (W, 2), (W, 2)))
        ones = torch.ones(1, 1, W, dtype=torch.bool)
        assert torch.equal(sdpa(q, k, v, None, 0.25), sdpa(q, k, v, ones, 0.25))
    cache = KVCache(1, 1, 32, 2, 16)
    backend = SdpaAttention()
    plan = backend.plan(torch.ones(1, 1, 1, dtype=torch.bool), _i64(9), cache, 6, 0.25)
    assert plan.mask is None and plan.width == 10
    # a tree, or requests of different lengths, keep their mask
    tree = torch.tril(torch.ones(1, 3, 3, dtype=torch.bool))
    assert backend.plan(tree, _i64(9), cache, 6, 0.25).mask is not None
    cache2 = KVCache(1, 2, 32, 2, 16)
    plan2 = backend.plan(torch.ones(2, 1, 1, dtype=torch.bool), _i64(4, 9), cache2, 6, 0.25)
    assert plan2.mask is not None and plan2.width == 10


@pytest.mark.parametrize("B", [1, 3, 6])
def test_kv_write_slices_equal_indexed_write(B):
    """The CPU write by slices (a few requests) and the indexed write give the same cache."""
    from heterospec import _checks
    from heterospec.models.kv_cache import KVCache

    g = torch.Generator().manual_seed(B)
    lens = torch.randint(0, 20, (B,), generator=g)
    k, v = torch.randn(B, 4, 2, 8, generator=g), torch.randn(B, 4, 2, 8, generator=g)
    fast, ref = KVCache(2, B, 24, 2, 8), KVCache(2, B, 24, 2, 8)
    fast.write(1, k, v, lens)
    with _checks.sync_free():            # no host reads: the indexed write
        ref.write(1, k, v, lens)
    assert torch.equal(fast.k, ref.k) and torch.equal(fast.v, ref.v) and fast.k[1].abs().sum() > 0
    with pytest.raises((IndexError, RuntimeError)):
        fast.write(0, k, v, torch.full((B,), 22))     # past max_length: an error, never clipped
    with pytest.raises(RuntimeError):
        fast.write(0, k.double(), v.double(), lens)   # another dtype: an error, never cast


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (slow)


def _smol_dir():
    from heterospec.defaults import ModelPackageMissing, default_target_dir

    try:
        return str(default_target_dir())     # a broken conversion fails the test, it is not a skip
    except ModelPackageMissing:
        return "/tmp/smol_hf" if os.path.isfile("/tmp/smol_hf/config.json") else None


@pytest.mark.slow
def test_smollm2_matches_transformers():
    d = _smol_dir()
    if d is None:
        pytest.skip("SmolLM2-135M-Instruct not available")
    from transformers import AutoModelForCausalLM

    tm = TargetModel.from_pretrained(d, dtype=torch.float32)
    assert tm.tokenizer is not None
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, local_files_only=True).eval()
    ids = tm.tokenizer("The capital of France is Paris. The capital of Italy", return_tensors="pt").input_ids
    T = ids.shape[1]
    ref, hs = _hf_reference(hf, ids)
    cache = tm.new_cache(1, T + 8)
    logits, feats = tm(ids, torch.arange(T)[None], cache, _i64(0))
    torch.testing.assert_close(logits, ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(feats, torch.cat([hs[i] for i in tm.config.aux_layers], -1), atol=2e-3, rtol=2e-3)
    # a small tree on top equals sequential decoding via HF
    parents = _i64(-1, 0, 0, 1, 3)[None]
    tree_mask, positions, _, _ = heterospec.build_tree(parents, _i64(5), _i64(T))
    toks = torch.tensor([[5, 17, 99, 1234, 42]])
    t_logits, _ = tm(toks, positions, cache, _i64(T), tree_mask, _i64(5))
    for i, path in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 3, 4]]):
        r, _ = _hf_reference(hf, torch.cat([ids, toks[:, path]], 1))
        torch.testing.assert_close(t_logits[0, i], r[0, -1], atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------------------------
# FlashInfer vs SDPA (GPU only)

needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or not flashinfer_available(),
    reason="needs CUDA and flashinfer",
)


@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashinfer_matches_sdpa(dtype):
    hf = tiny_llama(seed=10, hidden=256, heads=4, kv_heads=2, layers=4, vocab=211).to(dtype)  # head_dim 64
    fi = TargetModel.from_hf(hf, device="cuda", attn_backend="flashinfer")
    sd = TargetModel.from_hf(hf, device="cuda", attn_backend="sdpa")
    assert fi.backend.name == "flashinfer" and sd.backend.name == "sdpa"
    gen = torch.Generator().manual_seed(11)
    B, T, P = 3, 7, 13
    prompt_lens = torch.tensor([13, 4, 9])
    ids = torch.randint(0, 211, (B, P), generator=gen).cuda()
    num_nodes = _i64(7, 3, 1)
    parents = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        n = int(num_nodes[b])
        parents[b, :n] = torch.tensor(random_parents(n, gen))
    tree_mask, positions, _, _ = heterospec.build_tree(parents.cuda(), num_nodes.cuda(), prompt_lens.cuda())
    toks = torch.randint(0, 211, (B, T), generator=gen).cuda()
    outs = []
    for m in (fi, sd):
        cache = m.new_cache(B, 32)
        pf = m(ids, torch.arange(P, device="cuda").expand(B, P), cache, torch.zeros(B, dtype=torch.long, device="cuda"),
               num_nodes=prompt_lens.cuda())
        tv = m(toks, positions, cache, prompt_lens.cuda(), tree_mask, num_nodes.cuda())
        outs.append((pf, tv))
    tol = dict(atol=ATOL[torch.bfloat16], rtol=RTOL[torch.bfloat16])
    for b in range(B):
        n, p = int(num_nodes[b]), int(prompt_lens[b])
        torch.testing.assert_close(outs[0][0][0][b, :p], outs[1][0][0][b, :p], **tol)
        torch.testing.assert_close(outs[0][1][0][b, :n], outs[1][1][0][b, :n], **tol)
        torch.testing.assert_close(outs[0][1][1][b, :n].float(), outs[1][1][1][b, :n].float(), **tol)
