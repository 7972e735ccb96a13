"""Capture-ready rounds (issue: GPU path): static shapes and at most a few host reads per round.

The engine's CUDA mode (``Engine.static_rounds``) is exercised on CPU: the same code runs, and a
counter of device-to-host reads (``tolist`` / ``item`` / ``bool`` / ``int`` / ``float`` of a
tensor, and ops that synchronise on CUDA such as ``nonzero``) shows how many a round performs.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import heterospec
from heterospec import Engine, SpecConfig
from heterospec.entropy import EntropyBins
from heterospec.policy import Plan, Policy
from tests.engine_util import tiny_hf_llama

MAX_READS_PER_ROUND = 3
_READ_METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")
_SYNC_OPS = ("nonzero", "masked_select", "_local_scalar_dense", "unique", "_unique2")


class HostReads(TorchDispatchMode):
    """Counts host reads of tensor data: Python conversions and sync-implying ops."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.where = []
        self._saved = {}

    def __enter__(self):
        for name in _READ_METHODS:
            orig = getattr(torch.Tensor, name)
            self._saved[name] = orig

            def counted(t, *a, _orig=orig, _name=name, **k):
                self.count += 1
                self.where.append(_name)
                return _orig(t, *a, **k)
            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, orig)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in _SYNC_OPS:
            self.count += 1
            self.where.append(func.__name__)
        return func(*args, **(kwargs or {}))


class _FixedPolicy(Policy):
    def __init__(self, plan):
        self._plan = plan

    def plan(self, batch_size, context=None):
        return self._plan


def _engine(seed=3):
    hf = tiny_hf_llama(seed=seed)
    target = heterospec.TargetModel.from_hf(hf)
    draft = heterospec.Eagle3Draft.for_target(target, seed=seed)
    return Engine(target, draft, config=SpecConfig(top_k=3, depth=2, total_tokens=6),
                  bins=EntropyBins([0.5, 1.0, 2.0]))


def _count_round_reads(engine, prompts, **kw):
    """Generate with every round's draft half / verify half / commit counted (a split round's
    read between its halves included); returns (results, reads, rounds)."""
    counter = HostReads()
    phases = {}
    for name in ("_draft_half", "_verify_half", "_commit"):
        orig = getattr(engine, name)

        def wrapped(*a, _orig=orig, **k):
            with counter:
                return _orig(*a, **k)
        phases[name] = orig
        setattr(engine, name, wrapped)
    try:
        res = engine.generate_batch(prompts, chat=False, **kw)
    finally:
        for name, orig in phases.items():
            setattr(engine, name, orig)
    rounds = max(r.stats.rounds for r in res)
    return res, counter, rounds


@pytest.mark.parametrize("method,policy", [("eagle3", None), ("heterospec", "paper"), ("heterospec", "mixed")])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_static_round_reads_the_host_at_most_three_times(method, policy, temperature):
    engine = _engine()
    engine.static_rounds = True
    if policy == "mixed":   # bins with different depths and budgets in one batch
        policy = _FixedPolicy(Plan("mixed", decide_depth=1, entropy_k=3, edges=[1.0, 1.6],
                                   depth=[4, 2, 1], budget=[6, 4, 1]))
    prompts = [[5, 9, 17, 33], [7, 8, 9], [3, 4, 5, 6, 7, 8]]
    kw = dict(max_new_tokens=12, method=method, temperature=temperature, seed=1, policy=policy)
    res, counter, rounds = _count_round_reads(engine, prompts, **kw)
    assert rounds >= 3
    per_round = counter.count / rounds
    assert per_round <= MAX_READS_PER_ROUND, (per_round, sorted(set(counter.where)))
    if temperature == 0.0:   # greedy: static and dynamic rounds decode the same (the target's) tokens
        engine.static_rounds = False
        again = engine.generate_batch(prompts, chat=False, **kw)
        assert [r.token_ids for r in res] == [r.token_ids for r in again]


def test_counter_sees_the_dynamic_rounds_reads():
    """The negative control: the CPU mode reads the host many times per round, and the counter says so."""
    engine = _engine()
    engine.static_rounds = False
    _, counter, rounds = _count_round_reads(engine, [[5, 9, 17, 33], [7, 8, 9]], max_new_tokens=12,
                                            method="heterospec", policy="paper")
    assert counter.count / rounds > MAX_READS_PER_ROUND


def test_static_rounds_are_greedy_lossless():
    engine = _engine(seed=5)
    prompts = [[5, 9, 17, 33], [7, 8, 9, 10, 11]]
    ar = engine.generate_batch(prompts, max_new_tokens=16, method="autoregressive", chat=False)
    engine.static_rounds = True
    for method in ("eagle3", "heterospec"):
        out = engine.generate_batch(prompts, max_new_tokens=16, method=method, chat=False, policy="paper")
        assert [r.token_ids for r in out] == [r.token_ids for r in ar]


def test_the_done_mask_is_copied_to_the_device_only_when_a_request_finishes():
    """A replayed round reads which requests finished twice (the split's read, the verify
    graph's input); the mask is one host-to-device copy per change, not two per round."""
    from heterospec.engine import _Batch

    st = _Batch(prefix_lens=torch.zeros(3, dtype=torch.long), root=torch.zeros(3, dtype=torch.long),
                target_cache=None, finished=[None, None, None])
    first = st.done_mask("cpu")
    assert first.tolist() == [False, False, False] and st.done_mask("cpu") is first
    st.finished[1] = "eos"
    second = st.done_mask("cpu")
    assert second is not first and second.tolist() == [False, True, False]
    assert first.tolist() == [False, False, False]        # the earlier mask was not written over
    st.finished = [None, None]                            # a compacted batch
    assert st.done_mask("cpu").tolist() == [False, False]
