"""Decoding engine on CUDA (GPU only): greedy equivalence and the sampling law, in float32,
bfloat16 and float16, with the sdpa and FlashInfer attention backends.

tests/test_engine.py and tests/test_sampling_lossless.py run the same checks on CPU in float64.
On CUDA:
  * float32: the CUDA engine reproduces the CPU engine exactly (tokens and per-round records), and
    speculative greedy output equals autoregressive output exactly;
  * bfloat16 / float16: speculative greedy output equals autoregressive output up to the first
    position where the target's own top-2 logits are within rounding noise (the tree forward and
    the one-token forward round differently); a real bug (mask, KV compaction) diverges where the
    margin is large and fails;
  * sampling: 6000 requests of 3 tokens follow the target's law (chi-square), the law computed by
    enumeration with the same CUDA model in the same dtype, processed (temperature / top-k /
    top-p) by transformers' logits warpers, not by heterospec's processed_probs.
Models have head_dim 64 (FlashInfer needs 64 / 128 / 256).
"""

from __future__ import annotations

import pytest
import torch

from heterospec import Eagle3Draft, Engine, SpecConfig, TargetModel
from heterospec.config import SamplingParams
from heterospec.entropy import EntropyBins
from heterospec.models.attention import flashinfer_available
from tests.engine_util import tiny_hf_llama
from tests.sampling_ref import reference_probs
from tests.test_sampling_lossless import NEW, REQUESTS, VOCAB, assert_samples_follow_law

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SMALL = SpecConfig(top_k=3, depth=3, total_tokens=10)
F32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
# Largest top-1 / top-2 logit gap that rounding may flip (logits here reach ~10-20).
TIE = {BF16: 0.3, FP16: 0.06}
VARIANTS = [(F32, "sdpa"), (BF16, "sdpa"), (BF16, "flashinfer"), (FP16, "sdpa"), (FP16, "flashinfer")]


def _ids(cases):
    return ["-".join(str(x).replace("torch.", "") if not isinstance(x, SamplingParams) else f"T{x.temperature}"
                     for x in c) for c in cases]


def forced_bins(i: int, n: int = 4) -> EntropyBins:
    """n bins, every finite entropy in bin i (no bin flips between devices)."""
    return EntropyBins([-1e9 + j for j in range(i)] + [1e9 + j for j in range(n - 1 - i)])


def _engine(dtype, backend, device="cuda", seed=0, bins=0, **kw):
    if backend == "flashinfer" and not flashinfer_available():
        pytest.skip("flashinfer is not installed")
    hf = tiny_hf_llama(seed=seed, hidden=256, heads=4, kv_heads=2, layers=2, dtype=torch.float32, **kw)
    target = TargetModel.from_hf(hf, device=device, dtype=dtype, attn_backend=backend)
    draft = Eagle3Draft.for_target(target, seed=seed)
    return Engine(target, draft, config=SMALL, bins=forced_bins(bins))


def _prompts(vocab, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(4, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _top2_margin(engine, seq) -> float:
    """top-1 minus top-2 logit of the target's next-token prediction after `seq`."""
    t, dev = engine.target, engine.device
    cache = t.new_cache(1, len(seq) + 1)
    with torch.inference_mode():
        logits, _ = t(torch.tensor([seq], device=dev), torch.arange(len(seq), device=dev)[None], cache,
                      torch.zeros(1, dtype=torch.long, device=dev), return_features=False,
                      logits_index=torch.tensor([[len(seq) - 1]], device=dev))
    top = logits[0, 0].float().topk(2).values
    return float(top[0] - top[1])


def _assert_greedy_equivalent(engine, prompt, ref, out, dtype, what):
    if out == ref:
        return
    assert dtype != F32, f"{what}: float32 outputs differ: {out} vs {ref}"
    i = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
    margin = _top2_margin(engine, prompt + ref[:i])
    assert margin <= TIE[dtype], (f"{what}: diverges from autoregressive at token {i} where the target's top-2 "
                                  f"margin is {margin:.3f} > {TIE[dtype]} (not a rounding tie)")


def test_cuda_engine_reproduces_cpu_engine_float32():
    cpu, gpu = _engine(F32, "sdpa", device="cpu"), _engine(F32, "sdpa")
    for method in ("eagle3", "heterospec"):
        for prompt in _prompts(cpu.target.config.vocab_size):
            a = cpu.generate(prompt, max_new_tokens=20, method=method, chat=False)
            b = gpu.generate(prompt, max_new_tokens=20, method=method, chat=False)
            assert b.token_ids == a.token_ids, (method, prompt)
            ra = [(r.accept_len, r.verified, r.depth, r.bin) for r in a.stats.records]
            rb = [(r.accept_len, r.verified, r.depth, r.bin) for r in b.stats.records]
            assert rb == ra, (method, prompt)


@pytest.mark.parametrize("dtype,backend", VARIANTS, ids=_ids(VARIANTS))
@pytest.mark.parametrize("bins", [0, 3])   # 0: deepest drafting + fewest nodes (DED + TNP); 3: plain EAGLE tree
def test_greedy_speculative_equals_autoregressive(dtype, backend, bins):
    engine = _engine(dtype, backend, bins=bins)
    for prompt in _prompts(engine.target.config.vocab_size, seed=bins):
        ref = engine.generate(prompt, max_new_tokens=24, method="autoregressive", chat=False).token_ids
        for method in ("eagle3", "heterospec"):
            res = engine.generate(prompt, max_new_tokens=24, method=method, chat=False)
            _assert_greedy_equivalent(engine, prompt, ref, res.token_ids, dtype, f"{method} {dtype} {backend}")
            s = res.stats
            assert s.target_calls == s.rounds == len(s.records)


GRAPH_CASES = [(F32, "sdpa"), (BF16, "sdpa"), (BF16, "flashinfer")]


@pytest.mark.parametrize("dtype,backend", GRAPH_CASES, ids=_ids(GRAPH_CASES))
@pytest.mark.parametrize("method", ["eagle3", "heterospec"])
@pytest.mark.parametrize("graph_attention", ["sdpa", "split"])
def test_cuda_graphs_on_and_off_decode_the_same(dtype, backend, method, graph_attention):
    """Rounds replayed as CUDA graphs (the CUDA default) decode what eager rounds decode; a
    FlashInfer target's replayed forwards attend with SDPA (the default) or in two passes
    (SplitTreeAttention, FlashInfer over the prefix)."""
    if backend == "sdpa" and graph_attention == "split":
        pytest.skip("graph_attention applies to a FlashInfer target")
    engine = _engine(dtype, backend, bins=0)
    engine.graph_attention = graph_attention
    graphs = engine.round_graphs
    assert graphs is not None, "CUDA graphs are on by default on CUDA"
    prompts = _prompts(engine.target.config.vocab_size, n=3, seed=11)
    on = engine.generate_batch(prompts, max_new_tokens=40, method=method, chat=False)
    counts = dict(graphs.counts)
    assert counts.get("failed", 0) == 0 and counts.get("replayed", 0) >= 6, counts
    assert (backend == "flashinfer" and graph_attention == "split") == bool(engine._split)
    engine.round_graphs = None
    off = engine.generate_batch(prompts, max_new_tokens=40, method=method, chat=False)
    for p, a, b in zip(prompts, on, off):
        _assert_greedy_equivalent(engine, p, b.token_ids, a.token_ids, dtype, f"graphs on/off {method} {dtype} {backend}")


BATCH_CASES = [(F32, "sdpa"), (BF16, "flashinfer"), (FP16, "sdpa")]


@pytest.mark.parametrize("dtype,backend", BATCH_CASES, ids=_ids(BATCH_CASES))
def test_batch_of_different_lengths_matches_single_requests(dtype, backend):
    engine = _engine(dtype, backend)
    prompts = _prompts(engine.target.config.vocab_size, n=4, seed=5)
    batch = engine.generate_batch(prompts, max_new_tokens=16, method="heterospec", chat=False)
    for p, r in zip(prompts, batch):
        single = engine.generate(p, max_new_tokens=16, method="heterospec", chat=False).token_ids
        _assert_greedy_equivalent(engine, p, single, r.token_ids, dtype, f"batch vs single {dtype} {backend}")


PROMPT = [3, 5, 1, 7]


def _law(engine, params):
    """P(x1, x2, x3 | PROMPT) by enumeration with the engine's own target (same device and dtype),
    its logits processed by transformers' warpers (tests/sampling_ref.py)."""
    t, dev = engine.target, engine.device
    ctxs = [()] + [(a,) for a in range(VOCAB)] + [(a, b) for a in range(VOCAB) for b in range(VOCAB)]
    n = len(PROMPT) + 2
    ids = torch.zeros(len(ctxs), n, dtype=torch.long)
    last = torch.tensor([[len(PROMPT) + len(c) - 1] for c in ctxs])
    for r, c in enumerate(ctxs):
        ids[r, :len(PROMPT) + len(c)] = torch.tensor(PROMPT + list(c))
    cache = t.new_cache(len(ctxs), n)
    with torch.inference_mode():
        logits, _ = t(ids.to(dev), torch.arange(n, device=dev).expand(len(ctxs), n), cache,
                      torch.zeros(len(ctxs), dtype=torch.long, device=dev), return_features=False,
                      logits_index=last.to(dev))
    probs = reference_probs(logits[:, 0], params.temperature, params.top_k, params.top_p)
    p = {c: probs[r] for r, c in enumerate(ctxs)}
    return {(a, b, c): float(p[()][a] * p[(a,)][b] * p[(a, b)][c])
            for a in range(VOCAB) for b in range(VOCAB) for c in range(VOCAB)}


LAW_CASES = [
    (F32, "sdpa", SamplingParams(temperature=0.7, top_k=5, top_p=0.9)),
    (BF16, "sdpa", SamplingParams(temperature=1.0)),
    (BF16, "flashinfer", SamplingParams(temperature=1.0)),
    (FP16, "flashinfer", SamplingParams(temperature=1.0)),
]


@pytest.mark.parametrize("dtype,backend,params", LAW_CASES, ids=_ids(LAW_CASES))
def test_speculative_sampling_matches_target_law(dtype, backend, params):
    if backend == "flashinfer" and not flashinfer_available():
        pytest.skip("flashinfer is not installed")
    hf = tiny_hf_llama(vocab=VOCAB, hidden=256, layers=2, heads=4, kv_heads=2, seed=11, init_range=0.05,
                       dtype=torch.float32)
    target = TargetModel.from_hf(hf, device="cuda", dtype=dtype, attn_backend=backend)
    engine = Engine(target, Eagle3Draft.for_target(target, seed=2), config=SpecConfig(top_k=3, depth=2, total_tokens=8),
                    bins=EntropyBins([0.8, 1.6]))
    engine.target.config.eos_token_ids = ()
    res = engine.generate_batch([PROMPT] * REQUESTS, max_new_tokens=NEW, method="heterospec",
                                temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                seed=2024, chat=False)
    assert_samples_follow_law(res, _law(engine, params))


class _AlternatingPolicy:
    """Two plans of different depth, round after round (two draft graphs over two tree-buffer
    shapes live at once); tests/test_round_graphs.py has the CPU-emulated twin."""
    name = "alternating"

    def __init__(self):
        from heterospec.policy import Plan
        self.plans = [Plan("deep", decide_depth=1, entropy_k=3, edges=[1.0], depth=[7, 6], budget=[8, 7]),
                      Plan("shallow", decide_depth=1, entropy_k=3, edges=[1.0], depth=[1, 1], budget=[3, 2])]
        self.n = 0

    def plan(self, batch_size, context=None):
        self.n += 1
        return self.plans[self.n % 2]


@pytest.mark.parametrize("bin_graphs", [False, True])
@pytest.mark.parametrize("dtype,backend", [(BF16, "sdpa"), (BF16, "flashinfer")])
def test_alternating_plans_replay_into_live_tree_buffers(dtype, backend, bin_graphs):
    """Graphs of two plans replayed alternately, several calls on kept caches: greedy output equals
    autoregressive and nothing faults (26 Nov, H200: the draft freed the first plan's tree
    buffers when the second plan's were made, and a later replay wrote into freed memory).
    Without the split rounds each plan has buffers of its own shape; with them both plans'
    graphs share the envelope's (the deep plan's)."""
    from heterospec.policy import Policy

    engine = _engine(dtype, backend)
    engine.bin_graphs = bin_graphs
    assert engine.round_graphs is not None
    pol = type("Alt", (_AlternatingPolicy, Policy), {})()
    prompts = _prompts(engine.target.config.vocab_size, n=3)
    for call in range(3):
        ar = engine.generate_batch(prompts, max_new_tokens=32, method="autoregressive", chat=False)
        out = engine.generate_batch(prompts, max_new_tokens=32, method="heterospec", chat=False, policy=pol)
        for p, a, o in zip(prompts, ar, out):
            _assert_greedy_equivalent(engine, p, a.token_ids, o.token_ids, dtype, f"call {call}")
    torch.cuda.synchronize()
    assert engine.round_graphs.counts["replayed"] > 0


@pytest.mark.parametrize("dtype,backend", [(BF16, "sdpa")])
def test_moved_plans_of_one_option_replay_the_same_split_graphs(dtype, backend):
    """Split replayed rounds of plans that differ in their deepest bin and largest budget (the
    fitted policy's corrections move them) share the decide graph sized for the envelope, on a
    GPU as in the CPU emulation (tests/test_round_graphs.py); greedy output stays the target's."""
    from heterospec.policy import Plan, Policy

    class Alternating(Policy):
        plans = [Plan("deep", decide_depth=1, entropy_k=3, edges=[1.0, 1.6], depth=[4, 2, 1], budget=[6, 4, 1]),
                 Plan("shallow", decide_depth=1, entropy_k=3, edges=[1.0, 1.6], depth=[2, 2, 1], budget=[4, 3, 1])]
        n = 0

        def plan(self, batch_size, context=None):
            self.n += 1
            return self.plans[self.n % 2]

    engine = _engine(dtype, backend)
    prompts = _prompts(engine.target.config.vocab_size, n=3)
    ar = engine.generate_batch(prompts, max_new_tokens=32, method="autoregressive", chat=False)
    out = engine.generate_batch(prompts, max_new_tokens=32, method="heterospec", chat=False, policy=Alternating())
    for p, a, o in zip(prompts, ar, out):
        _assert_greedy_equivalent(engine, p, a.token_ids, o.token_ids, dtype, "moved plans")
    torch.cuda.synchronize()
    decide = [key for key in engine.round_graphs._graphs if key[0][0] == "decide"]
    assert len(decide) == 1, decide
    assert engine.round_graphs.counts["replayed"] > 0 and engine.round_graphs.counts.get("failed", 0) == 0
