"""Temperature > 0: speculative decoding keeps the target's distribution (statistical tests).

On a target with an 8-token vocabulary the exact law of the first three generated tokens is
enumerated (512 sequences). Thousands of requests are decoded in one batch (each with its own
tree) and a chi-square goodness-of-fit test compares the sample with the exact law. Positions 2
and 3 are produced by tree verification, so the test covers acceptance, rejection of siblings,
residual sampling and bonus tokens. A negative control shows the test rejects a biased verifier.
"""


import pytest
import torch

import heterospec
from heterospec import Engine, SpecConfig
from heterospec import ops as hops
from heterospec.config import SamplingParams
from heterospec.entropy import EntropyBins
from heterospec.sampling import processed_probs
from tests.engine_util import OracleDraft, tiny_hf_llama

VOCAB, NEW, REQUESTS, ALPHA = 8, 3, 6000, 1e-3
PROMPT = [3, 5, 1, 7]


def exact_law(hf, params):
    """P(x1, x2, x3 | prompt) by enumeration, with the same processing the engine applies."""
    law = {}
    with torch.no_grad():
        def dist(ctx):
            return processed_probs(hf(torch.tensor([PROMPT + list(ctx)])).logits[0, -1], params).double()
        p1 = dist(())
        for x1 in range(VOCAB):
            p2 = dist((x1,))
            for x2 in range(VOCAB):
                p3 = dist((x1, x2))
                for x3 in range(VOCAB):
                    law[(x1, x2, x3)] = float(p1[x1] * p2[x2] * p3[x3])
    return law


def chi_square_pvalue(samples, law):
    from scipy.stats import chi2

    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    cells = sorted(law, key=lambda c: -law[c])
    stat, dof, pooled_e, pooled_o = 0.0, -1, 0.0, 0
    for c in cells:
        e = law[c] * n
        if e >= 5:
            stat += (counts.get(c, 0) - e) ** 2 / e
            dof += 1
        else:                                   # pool rare sequences into one cell
            pooled_e += e
            pooled_o += counts.get(c, 0)
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        dof += 1
    impossible = sum(v for c, v in counts.items() if law.get(c, 0.0) == 0.0)
    return float(chi2.sf(stat, dof)), impossible


def _engine(draft_kind):
    hf = tiny_hf_llama(vocab=VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, seed=11, init_range=0.15)
    cfg = SpecConfig(top_k=3, depth=2, total_tokens=8)
    if draft_kind == "oracle":
        draft = OracleDraft(hf, noise=1.0, seed=1)
        draft.set_prompts([PROMPT] * REQUESTS)
        engine = Engine(hf, draft, config=cfg, bins=EntropyBins([0.8, 1.6]))
    else:
        target = heterospec.TargetModel.from_hf(hf)
        # "eagle3-bf16": a low-precision draft (what the CPU default picks) must not bias the law
        dtype = torch.bfloat16 if draft_kind == "eagle3-bf16" else torch.float64
        draft = heterospec.Eagle3Draft.for_target(target, seed=2).to(dtype)
        engine = Engine(target, draft, config=cfg, bins=EntropyBins([0.8, 1.6]))
    engine.target.config.eos_token_ids = ()     # the law below is over all 3-token continuations
    return engine, hf


@pytest.mark.parametrize("method,draft_kind,params", [
    ("autoregressive", "eagle3", SamplingParams(temperature=1.0)),
    ("eagle3", "eagle3", SamplingParams(temperature=1.0)),
    ("heterospec", "eagle3", SamplingParams(temperature=0.7, top_k=5, top_p=0.9)),
    ("heterospec", "oracle", SamplingParams(temperature=1.0)),
    ("heterospec", "eagle3-bf16", SamplingParams(temperature=1.0)),
])
def test_speculative_sampling_matches_target_law(method, draft_kind, params):
    engine, hf = _engine(draft_kind)
    res = engine.generate_batch([PROMPT] * REQUESTS, max_new_tokens=NEW, method=method,
                                temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                seed=2024, chat=False)
    assert_samples_follow_law(res, exact_law(hf, params), trees_used=method != "autoregressive")


def assert_samples_follow_law(results, law, trees_used: bool = True):
    """``results`` (one per request, NEW tokens each) pass the chi-square test against ``law``;
    with ``trees_used``, some rounds accepted drafts and some rejected them."""
    samples = [tuple(r.token_ids) for r in results]
    assert all(len(s) == NEW for s in samples)
    pvalue, impossible = chi_square_pvalue(samples, law)
    assert impossible == 0, "sampled a sequence the processed target law gives zero probability"
    assert pvalue > ALPHA, f"chi-square rejects the target law: p = {pvalue:.2e}"
    if trees_used:
        accepts = [r.accept_len for x in results for r in x.stats.records]
        assert 0 < sum(a > 0 for a in accepts) < len(accepts)


def test_negative_control_biased_verifier_is_detected(monkeypatch):
    """Accepting drafts too eagerly (halved coins) must fail the same test."""
    real = hops.verify_sampling

    def biased(tree_tokens, target_probs, first_child, next_sibling, num_nodes, coins, final_coins):
        return real(tree_tokens, target_probs, first_child, next_sibling, num_nodes, coins * 0.5, final_coins)

    monkeypatch.setattr(hops, "verify_sampling", biased)
    params = SamplingParams(temperature=1.0)
    engine, hf = _engine("eagle3")
    res = engine.generate_batch([PROMPT] * REQUESTS, max_new_tokens=NEW, method="eagle3", temperature=1.0,
                                seed=2024, chat=False)
    pvalue, _ = chi_square_pvalue([tuple(r.token_ids) for r in res], exact_law(hf, params))
    assert pvalue < ALPHA


def test_law_enumeration_is_normalised():
    hf = tiny_hf_llama(vocab=VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, seed=11, init_range=0.15)
    law = exact_law(hf, SamplingParams(temperature=0.7, top_k=5, top_p=0.9))
    assert abs(sum(law.values()) - 1.0) < 1e-6
