"""A bfloat16 target on CPU (SDPA): greedy divergences are rounding ties, the sampling law holds.

In bf16 the tree forward (many tokens per call) and the one-token forward round differently, so
speculative greedy output may leave the autoregressive one where the target's top-2 logits are
within rounding noise. ``heterospec.bench.first_divergence`` measures that gap in ulps of the top
logit; every divergence must be at most ``TIE_ULPS``. The negative control breaks the tree mask
(every node sees every other): its divergences are not ties and the same check rejects them.
These checks ran only as CUDA tests before (tests/test_cuda_engine.py).
"""

import torch

from heterospec import Engine, SpecConfig, TargetModel
from heterospec import ops as hops
from heterospec.bench import TIE_ULPS, first_divergence, mismatch_summary
from heterospec.config import SamplingParams
from heterospec.entropy import EntropyBins
from tests.engine_util import OracleDraft, tiny_hf_llama
from tests.sampling_ref import reference_probs
from tests.test_sampling_lossless import NEW, PROMPT, REQUESTS, VOCAB, assert_samples_follow_law

BF16 = torch.bfloat16
SMALL = SpecConfig(top_k=3, depth=3, total_tokens=10)


def _bf16_engine(seed=0, vocab=96):
    hf = tiny_hf_llama(seed=seed, vocab=vocab, hidden=64, heads=4, kv_heads=2, layers=2)
    target = TargetModel.from_hf(hf, dtype=BF16, attn_backend="sdpa")
    draft = OracleDraft(hf, noise=0.3, seed=seed)        # float64 proposals: mostly the bf16 target's choices
    return Engine(target, draft, config=SMALL, bins=EntropyBins([0.5, 1.0, 2.0])), draft


def _prompts(vocab, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _divergences(engine, draft, prompts, n=32):
    """(mismatches, accepted drafts): each speculative output against autoregressive."""
    mismatches, accepted = [], 0
    for p in prompts:
        draft.set_prompts([p])
        ref = engine.generate(p, max_new_tokens=n, method="autoregressive").token_ids
        for method in ("eagle3", "heterospec"):
            draft.set_prompts([p])
            out = engine.generate(p, max_new_tokens=n, method=method)
            accepted += sum(r.accept_len for r in out.stats.records)
            if out.token_ids != ref:
                mismatches.append(first_divergence(engine, p, ref, out.token_ids))
    return mismatches, accepted


def test_bf16_greedy_divergences_are_rounding_ties():
    engine, draft = _bf16_engine()
    engine.target.config.eos_token_ids = ()
    assert engine.target.lm_head.weight.dtype == BF16
    mismatches, accepted = _divergences(engine, draft, _prompts(96, 4, seed=1))
    assert accepted >= 100, "drafts must be accepted for the comparison to mean anything"
    bad = [m for m in mismatches if m["margin_ulps"] > TIE_ULPS]
    assert not bad, f"greedy divergences that are not rounding ties: {bad}"
    if mismatches:
        assert "every one at a rounding tie" in mismatch_summary(mismatches, str(BF16))


def test_bf16_tie_check_rejects_a_broken_tree_mask(monkeypatch):
    """Negative control: with the tree mask all ones the outputs diverge where the target's
    choice is clear, and the classification says so."""
    real = hops.build_tree

    def broken(tree_parents, num_nodes, prefix_lens):
        mask, positions, first_child, next_sibling = real(tree_parents, num_nodes, prefix_lens)
        return torch.ones_like(mask), positions, first_child, next_sibling

    monkeypatch.setattr(hops, "build_tree", broken)
    engine, draft = _bf16_engine()
    engine.target.config.eos_token_ids = ()
    mismatches, _ = _divergences(engine, draft, _prompts(96, 2, seed=1))
    assert any(m["margin_ulps"] > TIE_ULPS for m in mismatches), mismatches
    assert "NOT at a rounding tie" in mismatch_summary(mismatches, str(BF16))


def test_bf16_divergence_at_an_exact_tie_is_classified_a_tie():
    """Make token b's output row a copy of token a's, a the target's choice at step i: the two
    logits tie exactly there, and a divergence to b is a tie; a divergence at step 0, where the
    target's choice is clear, is not."""
    engine, _ = _bf16_engine()
    engine.target.config.eos_token_ids = ()
    prompt = [5, 6, 7]
    ref = engine.generate(prompt, max_new_tokens=8, method="autoregressive").token_ids
    i = next(j for j in range(1, len(ref)) if ref[j] not in ref[:j])
    a = ref[i]
    b = next(t for t in range(a + 1, 96) if t not in ref)     # above a: argmax keeps a, ref is unchanged
    with torch.no_grad():
        engine.target.lm_head.weight[b] = engine.target.lm_head.weight[a]
    assert engine.generate(prompt, max_new_tokens=8, method="autoregressive").token_ids == ref
    tie = first_divergence(engine, prompt, ref, ref[:i] + [b])
    assert tie["diverge_at"] == i and tie["top2_margin"] == 0.0 and tie["margin_ulps"] <= TIE_ULPS
    clear = first_divergence(engine, prompt, ref, [b] + ref[1:])
    assert clear["diverge_at"] == 0 and clear["margin_ulps"] > TIE_ULPS, clear
    assert "every one at a rounding tie" in mismatch_summary([tie], str(BF16))
    assert "1 NOT at a rounding tie" in mismatch_summary([tie, clear], str(BF16))


def _law_of_target(engine, params):
    """P(x1, x2, x3 | PROMPT) from the engine's own bf16 target (one prefill-shaped forward per
    context), processed by transformers' warpers."""
    t = engine.target
    ctxs = [()] + [(a,) for a in range(VOCAB)] + [(a, b) for a in range(VOCAB) for b in range(VOCAB)]
    n = len(PROMPT) + 2
    ids = torch.zeros(len(ctxs), n, dtype=torch.long)
    for r, c in enumerate(ctxs):
        ids[r, :len(PROMPT) + len(c)] = torch.tensor(PROMPT + list(c))
    last = torch.tensor([[len(PROMPT) + len(c) - 1] for c in ctxs])
    with torch.inference_mode():
        logits, _ = t(ids, torch.arange(n).expand(len(ctxs), n), t.new_cache(len(ctxs), n),
                      torch.zeros(len(ctxs), dtype=torch.long), return_features=False, logits_index=last)
    probs = reference_probs(logits[:, 0], params.temperature, params.top_k, params.top_p)
    p = {c: probs[r] for r, c in enumerate(ctxs)}
    return {(a, b, c): float(p[()][a] * p[(a,)][b] * p[(a, b)][c])
            for a in range(VOCAB) for b in range(VOCAB) for c in range(VOCAB)}


def test_bf16_target_keeps_the_sampling_law():
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    hf = tiny_hf_llama(vocab=VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, seed=11, init_range=0.15)
    target = TargetModel.from_hf(hf, dtype=BF16, attn_backend="sdpa")
    draft = OracleDraft(hf, noise=1.0, seed=1)
    draft.set_prompts([PROMPT] * REQUESTS)
    engine = Engine(target, draft, config=SpecConfig(top_k=3, depth=2, total_tokens=8),
                    bins=EntropyBins([0.8, 1.6]))
    engine.target.config.eos_token_ids = ()
    res = engine.generate_batch([PROMPT] * REQUESTS, max_new_tokens=NEW, method="heterospec",
                                temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                seed=2024, chat=False)
    assert_samples_follow_law(res, _law_of_target(engine, params))
