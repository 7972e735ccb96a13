"""Tiny random models for tests (no download). Reused by other test files."""

from __future__ import annotations

import torch


def tiny_llama_config(vocab=101, hidden=64, layers=6, heads=4, kv_heads=2, tied=False, head_dim=None,
                      intermediate=None, rope_theta=10000.0, rope_scaling=None, max_position=512, **extra):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_position, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        rope_theta=rope_theta, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra,
    )
    if head_dim is not None:
        kw["head_dim"] = head_dim
    if rope_scaling is not None:
        kw["rope_scaling"] = rope_scaling
    return LlamaConfig(**kw)


def tiny_llama(vocab=101, hidden=64, layers=6, heads=4, kv_heads=2, tied=False, seed=0, dtype=torch.float32,
               **kw):
    """An in-memory transformers LlamaForCausalLM with random weights (eval mode, sdpa attention)."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(vocab, hidden, layers, heads, kv_heads, tied, **kw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger-than-default weights so that logits are far from uniform
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    return model.to(dtype).eval()


def llama3_rope_scaling(original_max=32):
    return {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original_max}


def random_parents(T, gen):
    """Parents of a random topologically ordered tree of T nodes (position 0 = root)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]


def path_to(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]  # root first
