"""Temperature > 0: speculative decoding keeps the target's distribution (statistical tests).

On a target with an 8-token vocabulary the exact law of the first three generated tokens is
enumerated (512 sequences). Thousands of requests are decoded in one batch (each with its own
tree) and a chi-square goodness-of-fit test compares the sample with the exact law. Positions 2
and 3 are produced by tree verification, so the test covers acceptance, rejection of siblings
and bonus tokens.

Every method draws the token at a sequence position with the uniform keyed to (seed, request,
position) (heterospec/sampling.py), so a speculative method's sample must also be *token for
token* autoregressive sampling's with the same seed: each law test checks that identity as well,
which the chi-square test alone could not see (any exact sampler passes it).

Power: a second design (two tokens, 64 cells, 16,000 requests, a noisy oracle draft so that
acceptance matters) detects a 5 % bias in the keyed uniforms and tree rows keyed to the wrong
position; its negative controls apply exactly those biases and must fail. A verifier that
accepts drafts 5 % too eagerly breaks the identity with autoregressive sampling (its negative
control), where the chi-square test of this design alone does not resolve it.
With EOS enabled the law is over continuations cut at the first EOS.
The expected law never goes through heterospec's code: transformers computes the logits and
its logits warpers the processed distribution (tests/sampling_ref.py).
"""


import pytest
import torch

import heterospec
from heterospec import Engine, SpecConfig
from heterospec import ops as hops
from heterospec.config import SamplingParams
from heterospec.entropy import EntropyBins
from tests.engine_util import OracleDraft, stops_inside_accepted_path, tiny_hf_llama
from tests.sampling_ref import chi_square_pvalue, reference_probs

VOCAB, NEW, REQUESTS, ALPHA = 8, 3, 6000, 1e-3
PROMPT = [3, 5, 1, 7]
# The law tests' seed. Seed 2024 served until sampling was keyed; its keyed stream lands in an
# exact sampler's 0.1 % tail of this law's chi-square test, and with keyed draws every method
# samples that same stream (bench/RESULTS.md, seventy-ninth session: the p-values over other
# seeds, uniform). Changed once, for all the tests below, not tuned per test.
LAW_SEED = 2025


def exact_law(hf, params, new=NEW, eos=()):
    """P(x1 .. x_new | prompt) by enumeration: transformers' model and logits warpers
    (tests/sampling_ref.py), no engine code. A sequence ends early at a token of ``eos``."""
    law = {}

    def walk(ctx, p):
        if len(ctx) == new or (ctx and ctx[-1] in eos):
            law[ctx] = p
            return
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(ctx)])).logits[0, -1]
        probs = reference_probs(logits, params.temperature, params.top_k, params.top_p)
        for x in range(VOCAB):
            if probs[x] > 0:
                walk(ctx + (x,), p * float(probs[x]))

    walk((), 1.0)
    return law


def _engine(draft_kind, requests=REQUESTS):
    hf = tiny_hf_llama(vocab=VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, seed=11, init_range=0.15)
    cfg = SpecConfig(top_k=3, depth=2, total_tokens=8)
    if draft_kind == "oracle":
        draft = OracleDraft(hf, noise=1.0, seed=1)
        draft.set_prompts([PROMPT] * requests)
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
    kw = dict(max_new_tokens=NEW, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
              seed=LAW_SEED, chat=False)
    res = engine.generate_batch([PROMPT] * REQUESTS, method=method, **kw)
    assert_samples_follow_law(res, exact_law(hf, params), trees_used=method != "autoregressive")
    if method != "autoregressive":
        # Keyed draws: the speculative sample is autoregressive sampling's, request by request.
        ar = engine.generate_batch([PROMPT] * REQUESTS, method="autoregressive", **kw)
        assert [r.token_ids for r in res] == [r.token_ids for r in ar]


def assert_samples_follow_law(results, law, trees_used: bool = True):
    """``results`` pass the chi-square test against ``law`` (over sequences of NEW tokens, or
    shorter ones ending at EOS); with ``trees_used``, some rounds accepted drafts and some
    rejected them."""
    samples = [tuple(r.token_ids) for r in results]
    assert all(s in law for s in samples), "a sample is not a sequence the law is over (wrong length?)"
    pvalue, impossible = chi_square_pvalue(samples, law)
    assert impossible == 0, "sampled a sequence the processed target law gives zero probability"
    assert pvalue > ALPHA, f"chi-square rejects the target law: p = {pvalue:.2e}"
    if trees_used:
        accepts = [r.accept_len for x in results for r in x.stats.records]
        assert 0 < sum(a > 0 for a in accepts) < len(accepts)


POWER_NEW, POWER_REQUESTS = 2, 16000


def _biased(monkeypatch, kind):
    """A bias in the sampling: the keyed uniforms scaled by 0.95 (inverse CDF pushed towards low
    token ids, in every method alike); a verifier that accepts each node's first child with 1.05
    times the target's probability of it (drafts accepted too eagerly, as rejection sampling's coins
    scaled by 0.95); or tree rows keyed one position early (a node's row drawing with its parent's
    uniform)."""
    import heterospec.engine as engine_mod

    real_u = engine_mod.position_uniforms
    if kind == "uniforms*0.95":
        monkeypatch.setattr(engine_mod, "position_uniforms", lambda keys, pos: real_u(keys, pos) * 0.95)
    elif kind == "tree keys -1":
        # tree rows pass [B, T] positions, plain steps and prefill [B]
        monkeypatch.setattr(engine_mod, "position_uniforms",
                            lambda keys, pos: real_u(keys, pos - 1 if pos.dim() == 2 else pos))
    elif kind == "accept*1.05":
        from heterospec.sampling import processed_probs

        real_rows, real_verify, seen = engine_mod.draw_rows, hops.verify_greedy, {}
        gen = torch.Generator().manual_seed(0)

        def rows(logits, params, u):
            seen["probs"] = processed_probs(logits, params)
            return real_rows(logits, params, u)

        def eager(tree_tokens, target, first_child, next_sibling, num_nodes):
            child = tree_tokens.gather(1, first_child.clamp(min=0))
            p1 = seen["probs"].gather(2, child[..., None])[..., 0] / seen["probs"].sum(-1)
            q = (0.05 * p1 / (1 - p1)).clamp(0, 1)        # P(accept) = p1 + q (1 - p1) = 1.05 p1
            push = (first_child >= 0) & (torch.rand(target.shape, generator=gen) < q)
            return real_verify(tree_tokens, torch.where(push, child, target), first_child, next_sibling, num_nodes)
        monkeypatch.setattr(engine_mod, "draw_rows", rows)
        monkeypatch.setattr(hops, "verify_greedy", eager)
    else:
        raise ValueError(kind)


def _power_run():
    params = SamplingParams(temperature=1.0)
    engine, hf = _engine("oracle", requests=POWER_REQUESTS)
    res = engine.generate_batch([PROMPT] * POWER_REQUESTS, max_new_tokens=POWER_NEW, method="heterospec",
                                temperature=1.0, seed=LAW_SEED, chat=False)
    return res, exact_law(hf, params, new=POWER_NEW)


def test_sampling_law_with_power_for_a_five_percent_bias():
    res, law = _power_run()
    assert_samples_follow_law(res, law)


@pytest.mark.parametrize("kind", ["uniforms*0.95", "tree keys -1"])
def test_negative_control_biased_draws_fail_the_law(monkeypatch, kind):
    """A sampler whose draws are biased, in every method alike (uniforms) or in tree rows only
    (keys), fails the chi-square test."""
    _biased(monkeypatch, kind)
    res, law = _power_run()
    pvalue, _ = chi_square_pvalue([tuple(r.token_ids) for r in res], law)
    assert pvalue < ALPHA, f"{kind}: a biased sampler passes the chi-square test (p = {pvalue:.2e})"


@pytest.mark.parametrize("kind", ["accept*1.05", "tree keys -1"])
def test_negative_control_biased_verifier_breaks_identity_with_autoregressive(monkeypatch, kind):
    """A verifier that departs from the target's own draws breaks the token-for-token identity
    with autoregressive sampling, which the law tests check: a 5 % over-acceptance of the draft's
    first child is a shift the chi-square test of this design does not resolve on its own."""
    res_ar = _engine("oracle", requests=2000)[0].generate_batch(
        [PROMPT] * 2000, max_new_tokens=NEW, method="autoregressive", temperature=1.0, seed=LAW_SEED, chat=False)
    _biased(monkeypatch, kind)
    res = _engine("oracle", requests=2000)[0].generate_batch(
        [PROMPT] * 2000, max_new_tokens=NEW, method="heterospec", temperature=1.0, seed=LAW_SEED, chat=False)
    differ = sum(a.token_ids != b.token_ids for a, b in zip(res, res_ar))
    assert differ > 0, f"{kind}: the biased verifier's samples equal autoregressive sampling's"


@pytest.mark.parametrize("method", ["eagle3", "heterospec"])
def test_sampling_law_with_eos(method):
    """EOS enabled at temperature > 0: the law is over continuations cut at the first EOS, and
    some requests stop at an EOS that is an accepted draft (inside the path)."""
    engine, hf = _engine("oracle")
    eos = (4,)
    engine.target.config.eos_token_ids = list(eos)
    res = engine.generate_batch([PROMPT] * REQUESTS, max_new_tokens=NEW, method=method, temperature=1.0,
                                seed=7, chat=False)
    law = exact_law(hf, SamplingParams(temperature=1.0), eos=eos)
    assert_samples_follow_law(res, law)
    stopped = [r for r in res if r.finish_reason == "eos"]
    assert all(r.token_ids[-1] in eos and len(r.token_ids) <= NEW for r in stopped)
    assert sum(stops_inside_accepted_path(r) for r in stopped) >= 50


def test_law_enumeration_is_normalised():
    hf = tiny_hf_llama(vocab=VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, seed=11, init_range=0.15)
    law = exact_law(hf, SamplingParams(temperature=0.7, top_k=5, top_p=0.9))
    assert abs(sum(law.values()) - 1.0) < 1e-6
