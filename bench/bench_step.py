"""pytest-benchmark: per-step latency of the decoding loop (one draft-verify round, one AR step).

Runs on a small random model pair so that it is cheap everywhere (CI runs it once as a test with
``--benchmark-disable``); the real pair is measured end to end by ``bench/e2e.py``. Before timing,
each speculative method's greedy tokens are checked once against autoregressive decoding: a fast
round that emits wrong tokens is not a result.

    python -m pytest bench/bench_step.py --benchmark-only
"""

import pytest
import torch

import heterospec
from heterospec import Engine, SpecConfig
from heterospec.entropy import EntropyBins
from tests.engine_util import tiny_hf_llama

CFG = SpecConfig(top_k=4, depth=4, total_tokens=16)


@pytest.fixture(scope="module")
def engine():
    hf = tiny_hf_llama(vocab=2048, hidden=128, layers=4, heads=4, kv_heads=2, dtype=torch.float32, seed=0)
    target = heterospec.TargetModel.from_hf(hf)
    draft = heterospec.Eagle3Draft.for_target(target, seed=0)
    return Engine(target, draft, config=CFG, bins=EntropyBins([0.5, 1.0, 2.0, 3.0]))


PROMPT = list(range(5, 69))


def _check_against_autoregressive(engine, method, n=48):
    ref = engine.generate(PROMPT, max_new_tokens=n, method="autoregressive", chat=False)
    out = engine.generate(PROMPT, max_new_tokens=n, method=method, chat=False, policy="paper")
    assert out.token_ids == ref.token_ids, f"{method}: greedy tokens differ from autoregressive; not timing it"
    assert out.stats.rounds < len(ref.token_ids), f"{method}: no draft was ever accepted"   # else a trivial loop


def _state(engine, method):
    from heterospec.config import SamplingParams

    prompt = PROMPT
    # The paper's per-bin actions: a round that always speculates (the fitted policy may choose a
    # plain step on this device, which test_autoregressive_step times).
    pol = engine._policy(method, CFG, "paper")
    policy = pol.plan(1) if pol is not None else None
    st = engine._prefill([prompt], method, SamplingParams(), None, 64 + 4096, 4096, None)   # greedy: no keys
    return st, policy


@pytest.mark.parametrize("method", ["eagle3", "heterospec"])
def test_speculative_round(benchmark, engine, method):
    from heterospec.config import SamplingParams

    _check_against_autoregressive(engine, method)
    st, policy = _state(engine, method)

    def one_round():
        tree = engine._draft_tree(st, CFG, policy)
        verdict = engine._verify(st, tree, policy, SamplingParams())
        engine._commit(st, tree, verdict, 4096, None, 0.0, 0.0)

    with torch.inference_mode():
        benchmark.pedantic(one_round, rounds=20, iterations=1, warmup_rounds=2)
    assert st.stats[0].rounds >= 1


def test_autoregressive_step(benchmark, engine):
    from heterospec.config import SamplingParams

    st, _ = _state(engine, "autoregressive")
    with torch.inference_mode():
        benchmark.pedantic(lambda: engine._decode_one(st, SamplingParams(), 4096, None),
                           rounds=20, iterations=1, warmup_rounds=2)
    assert st.stats[0].target_calls >= 1
