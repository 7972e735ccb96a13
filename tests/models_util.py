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


def streamed_flag_ab(monkeypatch, flag: str, op: str, seed: int, off: dict = (), fuse: bool = True):
    """A tuned tiny float32 target (streamed layers) run twice, ``heterospec.models.target.<flag>``
    on then off (``off``: other flags of that module set for both runs): two forwards each (a
    4-token prefill, then 2 tokens after it). Returns ``((outputs, cache) on, (outputs, cache) off)``,
    outputs the forwards' logits and features; None where the "on" run never called
    ``heterospec::<op>`` (the tiny model's linears did not all stream here). ``fuse=False``: no
    sibling linears fused (each runs its own call). Every linear is timed fastest on its stream
    path (a throwaway linear-cost cache), so the layers stream on any machine."""
    import tempfile

    import heterospec.models.linear as linear_mod
    import heterospec.models.target as target_mod
    from heterospec import TargetModel
    from heterospec.models.linear import tune_linears

    monkeypatch.setenv("HETEROSPEC_CACHE", tempfile.mkdtemp(prefix="hs-forced-stream-"))
    monkeypatch.setattr(linear_mod, "_MEMORY", {})
    real = linear_mod.time_shape

    def timed(layer, *a, **k):
        t = real(layer, rows=linear_mod.TUNE_ROWS, budget_s=0.01, copies=1)
        if "stream_ms" in t:
            t["stream_ms"] = [1e-6] * len(t["rows"])
        return t
    monkeypatch.setattr(linear_mod, "time_shape", timed)
    model = TargetModel.from_hf(tiny_llama(seed=seed, dtype=torch.float32)).eval()
    tune_linears([model], progress=False, fuse=fuse)
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    pos = torch.arange(6).expand(2, 6)
    for name, value in dict(off).items():
        monkeypatch.setattr(target_mod, name, value)

    def run(on):
        monkeypatch.setattr(target_mod, flag, on)
        cache = model.new_cache(2, 16)
        with torch.inference_mode():
            out = [model(ids[:, :4], pos[:, :4], cache, torch.zeros(2, dtype=torch.long))]
            out.append(model(ids[:, 4:], pos[:, 4:], cache, torch.full((2,), 4)))
        return [t for o in out for t in o], cache

    with torch.profiler.profile() as prof:
        on = run(True)
    if f"heterospec::{op}" not in {e.name for e in prof.events()}:
        return None
    return on, run(False)
