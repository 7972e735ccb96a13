"""CUDA graphs of a round's two halves (heterospec.graphs), tested on CPU through the emulation,
which keeps the CUDA contract (static inputs copied before each replay, outputs overwritten in
place by the next replay, Python state baked in at capture). tests/test_cuda_engine.py runs the
real graphs on a GPU."""

import pytest
import torch

import heterospec
from heterospec import Engine, SpecConfig
from heterospec.entropy import EntropyBins
from heterospec.graphs import RoundGraphs
from heterospec.policy import Plan, Policy
from tests.engine_util import tiny_hf_llama


class _FixedPolicy(Policy):
    def __init__(self, plan):
        self._plan = plan

    def plan(self, batch_size, context=None):
        return self._plan


MIXED = Plan("mixed", decide_depth=1, entropy_k=3, edges=[1.0, 1.6], depth=[4, 2, 1], budget=[6, 4, 1])
PROMPTS = [[5, 9, 17, 33], [7, 8, 9], [3, 4, 5, 6, 7, 8]]


def _engine(seed=3, graphs=True):
    hf = tiny_hf_llama(seed=seed)
    target = heterospec.TargetModel.from_hf(hf)
    draft = heterospec.Eagle3Draft.for_target(target, seed=seed)
    engine = Engine(target, draft, config=SpecConfig(top_k=3, depth=2, total_tokens=6),
                    bins=EntropyBins([0.5, 1.0, 2.0]))
    engine.static_rounds = True
    engine.round_graphs = RoundGraphs("cpu", emulate=True) if graphs else None
    draft.kernel_friendly_attention = True     # CUDA's formulation and static tree-buffer layout
    return engine


@pytest.mark.parametrize("method,policy", [("eagle3", None), ("heterospec", "paper"), ("heterospec", "mixed")])
def test_replayed_rounds_are_greedy_lossless(method, policy):
    engine = _engine()
    policy = _FixedPolicy(MIXED) if policy == "mixed" else policy
    ar = engine.generate_batch(PROMPTS, max_new_tokens=20, method="autoregressive", chat=False)
    out = engine.generate_batch(PROMPTS, max_new_tokens=20, method=method, chat=False, policy=policy)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    c = engine.round_graphs.counts
    assert c["captured"] >= 2 and c["replayed"] > c["captured"], dict(c)   # both halves replayed


def test_replayed_sampling_draws_what_eager_rounds_draw():
    """The capture's own run rewinds the generator: a seeded sampling run is the same with graphs."""
    kw = dict(max_new_tokens=20, method="heterospec", chat=False, policy=_FixedPolicy(MIXED),
              temperature=0.9, top_p=0.95, seed=7)
    eager = _engine(graphs=False).generate_batch(PROMPTS, **kw)
    engine = _engine()
    graphed = engine.generate_batch(PROMPTS, **kw)
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
    assert engine.round_graphs.counts["replayed"] > 0


@pytest.mark.parametrize("split", [False, True])
def test_plain_steps_between_rounds_reuse_the_padded_extend(split):
    """A plain step grows the pending extend by one column; the draft half pads it to a bucket,
    so rounds after plain steps replay the same graph instead of capturing new ones. With the
    split attention, the host-side prefix lengths follow the plain steps too."""
    from heterospec.models.attention import SplitTreeAttention, TorchPrefixPass

    class Alternating(Policy):
        def __init__(self):
            self.i = 0

        def plan(self, batch_size, context=None):
            self.i += 1
            return MIXED if self.i % 3 else Plan("plain", speculate=False)

    engine = _engine()
    engine.bin_graphs = False      # one draft graph per plan: the counts below (split rounds: further down)
    if split:
        engine.split_attention_factory = lambda B: SplitTreeAttention(TorchPrefixPass())
    ar = engine.generate_batch(PROMPTS, max_new_tokens=30, method="autoregressive", chat=False)
    out = engine.generate_batch(PROMPTS, max_new_tokens=30, method="heterospec", chat=False, policy=Alternating())
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    assert any(r.plain for r in out[0].stats.records)
    c = engine.round_graphs.counts
    # the autoregressive call's plain-step graph (dropped with its caches), then the draft half,
    # the verify half and the drafting plain step: nothing captured twice
    assert c["captured"] <= 4 and c["replayed"] >= 8, dict(c)


class _Alternating(Policy):
    """Each round's plan in turn from ``plans``."""

    def __init__(self, *plans):
        self.plans, self.i = plans, 0

    def plan(self, batch_size, context=None):
        self.i += 1
        return self.plans[self.i % len(self.plans)]


# MIXED's shape (decide after 1 forward, K 3, 3 bins, 4 forwards at most, 6 nodes at most) with
# other edges and other per-bin actions
MIXED_MOVED = Plan("moved", decide_depth=1, entropy_k=3, edges=[5.0, 9.0], depth=[4, 1, 2], budget=[6, 1, 4])


def _alternating_as_eager(*plans):
    """Rounds alternating ``plans`` with graphs (emulated) and eagerly: the same records (bin,
    depth, verified nodes, accepted) and tokens. Returns the graphed engine and the records."""
    def records(engine):
        out = engine.generate_batch(PROMPTS, max_new_tokens=24, method="heterospec", chat=False,
                                    policy=_Alternating(*plans))
        return out, [[(r.bin, r.depth, r.verified, r.accept_len) for r in o.stats.records] for o in out]

    eager_out, eager = records(_engine(graphs=False))
    engine = _engine()
    graphed_out, graphed = records(engine)
    assert graphed == eager
    assert [r.token_ids for r in graphed_out] == [r.token_ids for r in eager_out]
    return engine, eager


def test_plans_that_differ_only_in_their_actions_share_one_draft_graph():
    """The fitted policy's plans move with its online corrections: a replayed draft half takes
    the plan's edges, depths and budgets as inputs, so a moved plan replays the same graph, and
    decides exactly as an eager round with that plan does."""
    engine, eager = _alternating_as_eager(MIXED, MIXED_MOVED)
    assert len({r[0] for rs in eager for r in rs}) > 1, "both plans' bins should occur"
    # (a plan whose bins act differently splits its draft half at the decision: "decide", then
    # one "deeper" graph per forwards count, shared by the plans as well)
    draft_graphs = [key for key in engine.round_graphs._graphs if key[0][0] in ("draft", "decide")]
    assert len(draft_graphs) == 1, draft_graphs
    assert engine.round_graphs.counts["replayed"] > 10


MIXED_SHALLOW = Plan("shallow", decide_depth=1, entropy_k=3, edges=[1.0, 1.6], depth=[2, 2, 1], budget=[4, 3, 1])


def test_split_rounds_of_plans_of_another_depth_and_budget_share_their_graphs():
    """The fitted policy's corrections also move a plan's deepest bin and largest budget. Split
    rounds size their buffers for the deepest plan so far (the envelope) and key their graphs by
    the binning option, so a plan of the same option but shallower, or with smaller budgets,
    replays the same decide graph and the deeper graphs of the forwards it runs (on an H100 a
    key per plan made ~60 captures in 12 calls), and decides and accepts as eager rounds do."""
    engine, _ = _alternating_as_eager(MIXED, MIXED_SHALLOW)
    decide = [key for key in engine.round_graphs._graphs if key[0][0] == "decide"]
    assert len(decide) == 1, decide
    deeper = {key[0][2] for key in engine.round_graphs._graphs if key[0][0] == "deeper"}
    assert len(deeper) == len([k for k in engine.round_graphs._graphs if k[0][0] == "deeper"])  # one per forwards
    assert engine._split_depth == MIXED.max_depth


def test_the_next_extend_is_as_wide_as_the_longest_accepted_path():
    """After a replayed round the draft's next extend holds the accepted path: root + at most
    depth + 1 layers. It once had the verified tree's width (static), so the next draft graph's
    width followed the plan's budget: a graph per budget, and 96 columns of extend for the ~9 a
    round can accept (H100, 26 Nov). With budgets wider than the bucket, every draft graph here
    is one bucket wide, and the output is the eager engine's."""
    from heterospec.engine import _EXTEND_BUCKET

    wide = Plan("wide", decide_depth=1, entropy_k=3, edges=[1.0, 1.6], depth=[3, 2, 1],
                budget=[2 * _EXTEND_BUCKET + 3, _EXTEND_BUCKET + 2, 4])
    kw = dict(max_new_tokens=24, method="heterospec", chat=False)
    want = _engine(graphs=False).generate_batch(PROMPTS, **kw, policy=_FixedPolicy(wide))
    for split in (True, False):
        engine = _engine()
        engine.bin_graphs = split
        got = engine.generate_batch(PROMPTS, **kw, policy=_FixedPolicy(wide))
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        widths = {key[1][0][0][1] for key in engine.round_graphs._seen if key[0][0] in ("decide", "draft")}
        assert widths == {_EXTEND_BUCKET}, (split, widths)
        assert engine.round_graphs.counts["replayed"] > 0


def test_an_outgrown_cache_doubles():
    """Calls of growing length reallocate the kept cache (and drop every graph) a logarithmic
    number of times: an outgrown cache is replaced by one of at least twice its length."""
    engine = _engine()
    engine.max_length = 1 << 16
    first = engine._new_cache(engine.target, 2, 300)
    second = engine._new_cache(engine.target, 2, first.k.shape[2] + 1)
    assert second.k.shape[2] >= 2 * first.k.shape[2]
    assert engine._new_cache(engine.target, 2, first.k.shape[2] + 2).k is second.k


def _bin_spreading_plan(engine):
    """MIXED's actions with edges at the terciles of the path entropies this engine's rounds
    meet (eager rounds), so that replayed rounds see every bin."""
    out = engine.generate_batch(PROMPTS, max_new_tokens=24, method="heterospec", chat=False,
                                policy=_FixedPolicy(MIXED))
    ent = sorted(r.entropy for o in out for r in o.stats.records)
    edges = [ent[len(ent) // 3], ent[2 * len(ent) // 3]]
    return Plan("spread", decide_depth=1, entropy_k=3, edges=edges, depth=[4, 2, 1], budget=[6, 4, 1])


@pytest.mark.parametrize("sampling", [False, True])
def test_replayed_rounds_draft_and_verify_the_batch_s_own_bins(sampling):
    """A plan whose bins act differently replays as a decide graph, one host read of the batch's
    deepest bin and largest budget, and the graphs of that (forwards, nodes): the rounds decide,
    draft and accept exactly as eager rounds do, and rounds of shallow batches run graphs of
    their own instead of the plan's deepest."""
    plan = _bin_spreading_plan(_engine(graphs=False))
    kw = dict(max_new_tokens=24, method="heterospec", chat=False, policy=_FixedPolicy(plan))
    if sampling:
        kw.update(temperature=0.9, top_p=0.95, seed=3)

    def records(out):
        return [[(r.bin, r.depth, r.accept_len) for r in o.stats.records] for o in out]

    eager = _engine(graphs=False).generate_batch(PROMPTS, **kw)
    engine = _engine()
    graphed = engine.generate_batch(PROMPTS, **kw)
    keys = list(engine.round_graphs._graphs)
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
    assert records(graphed) == records(eager)
    if not sampling:
        ar = engine.generate_batch(PROMPTS, max_new_tokens=24, method="autoregressive", chat=False)
        assert [r.token_ids for r in graphed] == [r.token_ids for r in ar]
    assert len({r[0] for rs in records(eager) for r in rs}) == 3, "every bin should occur"
    deeper = {k[0][2] for k in keys if k[0][0] == "deeper"}
    verify = {k[0][1] for k in keys if k[0][0] == "verify"}
    assert len(deeper) > 1 or len(verify) > 1, (deeper, verify)
    assert not any(k[0][0] == "draft" for k in keys)


def test_split_rounds_read_the_host_at_most_three_times():
    from tests.test_capture_ready import MAX_READS_PER_ROUND, HostReads

    engine = _engine()
    plan = _bin_spreading_plan(_engine(graphs=False))
    counter = HostReads()
    saved = {}
    for name in ("_draft_half", "_verify_half", "_commit"):
        saved[name] = orig = getattr(engine, name)

        def wrapped(*a, _orig=orig, **k):
            with counter:
                return _orig(*a, **k)
        setattr(engine, name, wrapped)
    res = engine.generate_batch(PROMPTS, max_new_tokens=16, method="heterospec", chat=False,
                                policy=_FixedPolicy(plan))
    rounds = max(r.stats.rounds for r in res)
    assert rounds >= 3 and counter.count / rounds <= MAX_READS_PER_ROUND, (counter.count, rounds)
    assert any(k[0][0] == "deeper" for k in engine.round_graphs._graphs)


def test_interleaved_methods_and_lengths_reuse_the_kept_caches_and_their_graphs():
    """Calls of different methods (different tree capacities, so different cache lengths) and
    prompt lengths, interleaved as a benchmark or a server runs them: once the kept cache has
    grown to the longest call (during the first pass: a graph captured before that is captured
    again once), every call replays graphs captured before; none is dropped or captured again."""
    from heterospec.engine import _CACHE_BUCKET

    engine = _engine()
    # just under a cache bucket: the methods' tree capacities put their caches on both sides of it
    longer = [(p * _CACHE_BUCKET)[:_CACHE_BUCKET - 24 - i] for i, p in enumerate(PROMPTS)]
    calls = [(m, ps) for ps in (PROMPTS, longer) for m in ("autoregressive", "eagle3", "heterospec")]

    def one_pass():
        for method, prompts in calls:
            engine.generate_batch(prompts, max_new_tokens=16, method=method, chat=False,
                                  policy=_FixedPolicy(MIXED) if method == "heterospec" else None)

    one_pass()
    one_pass()
    c = engine.round_graphs.counts
    first = dict(c)
    one_pass()
    assert c["captured"] == first["captured"] and c["first"] == first["first"], (first, dict(c))
    assert c.get("dropped", 0) == first.get("dropped", 0), (first, dict(c))
    assert c["replayed"] > first["replayed"]


def test_a_much_smaller_call_gets_a_cache_of_its_own():
    from heterospec.engine import _CACHE_SLACK

    engine = _engine()
    big = engine._new_cache(engine.target, 2, 3 * _CACHE_SLACK)
    assert engine._new_cache(engine.target, 2, 2 * _CACHE_SLACK).k is big.k          # fits, little spare
    assert engine._new_cache(engine.target, 2, 100).k is not big.k                   # mostly spare: its own
    assert engine._new_cache(engine.target, 3, 100).k.shape[1] == 3                  # another batch size


def test_replayed_rounds_after_long_plain_stretches_keep_the_window():
    """Static rounds (CUDA) stop growing the pending extend at 2 * draft_window columns (or the
    tree's width) and drop rows' oldest entries on the device: greedy output unchanged, and the
    draft half's extend stops growing (no new graphs for longer stretches)."""

    class Stretches(Policy):
        def __init__(self):
            self.i = 0

        def plan(self, batch_size, context=None):
            return MIXED

        def round_plan(self, batch_size, context=None, tokens_left=None, catchup=None, timed=True):
            self.i += 1
            return MIXED if self.i % 9 == 0 else Plan("plain", speculate=False)

    engine = _engine()
    engine.bin_graphs = False      # one "draft" graph per plan: the extend widths it is given
    ar = engine.generate_batch(PROMPTS, max_new_tokens=40, method="autoregressive", chat=False)
    widths, run = [], engine.round_graphs.run

    def spy(key, fn, inputs, **kw):
        if key[0] == "draft":
            widths.append(inputs[0].shape[1])        # the pending extend's columns
        return run(key, fn, inputs, **kw)

    engine.round_graphs.run = spy
    widest = {}
    for window in (2, None):
        engine.draft_window, widths[:] = window, []
        out = engine.generate_batch(PROMPTS, max_new_tokens=40, method="heterospec", chat=False, policy=Stretches())
        assert [r.token_ids for r in out] == [r.token_ids for r in ar]
        assert sum(not r.plain for r in out[0].stats.records) >= 3
        widest[window] = max(widths)
    # after a round the columns are the verified tree's (its accepted path); the window keeps
    # plain steps from adding more
    tree = MIXED.max_nodes + 1
    assert widest[2] <= max(4, tree) < widest[None], widest


def test_rounds_that_capture_are_not_timed_for_the_policy():
    """A round or plain step that ran a configuration's first eager run or captured its graph
    reaches the policy untimed (seconds=None): on an H200 such rounds took 3x a replayed one and
    the fitted policy's time correction stopped speculation for the whole run. (So does a plain
    step right after a speculative round or right after the prefill, in every engine: a switch.)"""

    class Recording(Policy):
        def __init__(self):
            self.i, self.seconds, self.switch, self.kinds = 0, [], [], []

        def plan(self, batch_size, context=None):
            self.i += 1
            return MIXED if self.i % 3 else Plan("plain", speculate=False)

        def observe(self, plan, bins, accepted, seconds, **kw):
            self.switch.append(not plan.speculate and (not self.kinds or self.kinds[-1]))
            self.kinds.append(plan.speculate)
            self.seconds.append(seconds)

    engine, pol = _engine(), Recording()
    engine.bin_graphs = False      # one graph per half: the configurations counted below
    engine.generate_batch(PROMPTS, max_new_tokens=30, method="heterospec", chat=False, policy=pol)
    assert any(pol.switch) and all(s is None for s, w in zip(pol.seconds, pol.switch) if w)
    untimed = sum(s is None for s, w in zip(pol.seconds, pol.switch) if not w)
    one_offs = engine.round_graphs.one_offs()
    assert one_offs >= 3, dict(engine.round_graphs.counts)   # draft, verify, plain step: first run + capture
    assert 1 <= untimed <= one_offs, (untimed, one_offs)
    assert len(pol.seconds) - untimed - sum(pol.switch) >= 5 and all(s is None or s > 0 for s in pol.seconds)
    # eager engines time every round but the switches, also where a call starts with plain steps
    starts = []
    for first in (0, 1, 2):               # (the plan calls before the first round move pol.i too)
        eager, pol2 = _engine(graphs=False), Recording()
        pol2.i = first
        eager.generate_batch(PROMPTS, max_new_tokens=30, method="heterospec", chat=False, policy=pol2)
        assert pol2.seconds and all((s is None) == w for s, w in zip(pol2.seconds, pol2.switch))
        assert sum(s is not None for s in pol2.seconds) >= 5
        starts.append(pol2.kinds[0])
    assert set(starts) == {True, False}    # calls that start speculating and calls that start plain


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("sampling", [False, True])
def test_plain_steps_are_replayed_too(split, sampling):
    """Autoregressive decoding (and HeteroSpec's plain rounds) replay one graph per step instead of
    launching a one-token forward eagerly (launch-bound on a GPU); same tokens, same draws."""
    from heterospec.models.attention import SplitTreeAttention, TorchPrefixPass

    kw = dict(max_new_tokens=24, method="autoregressive", chat=False)
    if sampling:      # a seed whose draws run to max_new_tokens (an early EOS leaves few steps to replay)
        kw.update(temperature=0.8, top_p=0.9, seed=8)
    eager = _engine(graphs=False).generate_batch(PROMPTS, **kw)
    engine = _engine()
    if split:
        engine.split_attention_factory = lambda B: SplitTreeAttention(TorchPrefixPass())
    graphed = engine.generate_batch(PROMPTS, **kw)
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
    c = engine.round_graphs.counts
    assert c["captured"] == 1 and c["replayed"] >= 20, dict(c)


def test_engine_graph_switch():
    hf = tiny_hf_llama(seed=1)
    target = heterospec.TargetModel.from_hf(hf)
    assert Engine(target).round_graphs is None          # CPU default: off
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        Engine(target, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be True, False or None"):
        Engine(target, cuda_graphs="yes")


# -- RoundGraphs on its own ------------------------------------------------------------------------
def _double(x, y):
    return [x * 2, None, y + x.sum()]


def test_captures_on_second_sight_and_replays_into_the_same_outputs():
    g = RoundGraphs("cpu", emulate=True)
    a = g.run("k", _double, [torch.tensor([1.0, 2.0]), torch.tensor([0.0])])
    assert g.counts["eager"] == 1 and len(g) == 0 and a[1] is None
    b = g.run("k", _double, [torch.tensor([3.0, 4.0]), torch.tensor([1.0])])
    assert g.counts["captured"] == 1 and b[0].tolist() == [6.0, 8.0] and b[2].tolist() == [8.0]
    c = g.run("k", _double, [torch.tensor([5.0, 6.0]), torch.tensor([0.0])])
    assert c[0] is b[0], "a replay writes into the captured outputs, as a CUDA graph does"
    assert b[0].tolist() == [10.0, 12.0] and c[2].tolist() == [11.0]
    # another shape is another configuration
    g.run("k", _double, [torch.zeros(3), torch.zeros(1)])
    assert g.counts["eager"] == 2


def test_narrower_inputs_fill_the_leading_part_of_their_buffer():
    seen = []

    def fn(x):
        seen.append(x.shape)
        return [x.sum(dim=1)]

    g = RoundGraphs("cpu", emulate=True, capture_after=0)
    out = g.run("k", fn, [torch.ones(2, 3)], shapes=[(2, 8)])
    assert seen[-1] == (2, 8) and out[0].tolist() == [3.0, 3.0]
    out = g.run("k", fn, [torch.full((2, 5), 2.0)], shapes=[(2, 8)])
    assert out[0].tolist() == [10.0, 10.0]
    with pytest.raises(ValueError, match="does not fit its static buffer"):
        g.run("k", fn, [torch.ones(2, 9)], shapes=[(2, 8)])


def test_new_cache_storage_drops_every_graph_and_old_ones_are_evicted():
    g = RoundGraphs("cpu", emulate=True, capture_after=0, max_graphs=2)
    cache = torch.zeros(4)
    g.bind_storage(cache)
    for key in ("a", "b", "c"):
        g.run(key, _double, [torch.ones(2), torch.ones(1)])
    assert len(g) == 2 and g.counts["dropped"] == 1          # least recently used went
    g.bind_storage(cache)                                     # same storage: kept
    assert len(g) == 2
    g.bind_storage(torch.zeros(4))                            # a new cache: all dropped
    assert len(g) == 0 and g.counts["dropped"] == 3


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="max_graphs must be >= 1"):
        RoundGraphs("cpu", emulate=True, max_graphs=0)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        RoundGraphs("cpu")


# -- the split (prefix + tree) attention of a FlashInfer target's replayed verification ----------
def _random_tree_case(B=3, T=5, S=24, Hq=4, Hkv=2, D=8, dtype=torch.float64, seed=0):
    from heterospec import ops
    from heterospec.models.kv_cache import KVCache

    g = torch.Generator().manual_seed(seed)
    prefix = torch.tensor([3, 11, 7])[:B]
    parents = torch.full((B, T), -1, dtype=torch.int64)
    for b in range(B):
        for i in range(1, T):
            parents[b, i] = int(torch.randint(0, i, (1,), generator=g))
    num_nodes = torch.tensor([T, T - 2, 1])[:B]
    tree_mask, _, _, _ = ops.build_tree(parents, num_nodes, prefix)
    cache = KVCache(1, B, S, Hkv, D, dtype=dtype)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g, dtype=torch.float64).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g, dtype=torch.float64).to(dtype))
    q = torch.randn(B, T, Hq, D, generator=g, dtype=torch.float64).to(dtype)
    return q, cache, tree_mask, prefix


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_split_attention_equals_one_pass_attention(dtype, tol):
    from heterospec.models.attention import SdpaAttention, SplitTreeAttention, TorchPrefixPass

    q, cache, tree_mask, prefix = _random_tree_case(dtype=dtype)
    B, T, Hq, D = q.shape
    scale = D ** -0.5
    ref_backend = SdpaAttention()
    ref = ref_backend.run(ref_backend.plan(tree_mask, prefix, cache, Hq, scale), q, cache.k[0], cache.v[0])
    split = SplitTreeAttention(TorchPrefixPass())
    split.host_plan(prefix.tolist(), T, Hq, cache, scale)
    out = split.run(split.plan(tree_mask, prefix, cache, Hq, scale), q, cache.k[0], cache.v[0])
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)


def test_split_attention_needs_its_host_plan():
    from heterospec.models.attention import SplitTreeAttention, TorchPrefixPass

    q, cache, tree_mask, prefix = _random_tree_case()
    split = SplitTreeAttention(TorchPrefixPass())
    with pytest.raises(RuntimeError, match="call host_plan for a \\[3, 5\\] tree"):
        split.plan(tree_mask, prefix, cache, 4, 0.3)
    split.host_plan(prefix.tolist(), 4, 4, cache, 0.3)          # planned for another tree size
    with pytest.raises(RuntimeError, match="last host plan: \\(3, 4\\)"):
        split.plan(tree_mask, prefix, cache, 4, 0.3)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_replayed_split_attention_rounds_decode_what_the_target_decodes(temperature):
    """The FlashInfer target's graph path on CPU: the verification replays with the split
    attention, its prefix pass planned on the host from the engine's host-side lengths (here the
    torch prefix pass stands in for FlashInfer's)."""
    from heterospec.models.attention import SplitTreeAttention, TorchPrefixPass

    engine = _engine()
    engine.split_attention_factory = lambda B: SplitTreeAttention(TorchPrefixPass())
    kw = dict(max_new_tokens=24, chat=False, temperature=temperature, seed=3)
    ref = _engine(graphs=False).generate_batch(PROMPTS, method="heterospec", policy=_FixedPolicy(MIXED), **kw) \
        if temperature else engine.generate_batch(PROMPTS, method="autoregressive", **kw)
    out = engine.generate_batch(PROMPTS, method="heterospec", policy=_FixedPolicy(MIXED), **kw)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert engine._split and engine.round_graphs.counts["replayed"] > 4, dict(engine.round_graphs.counts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_prefix_pass_split_equals_sdpa_on_cuda(dtype):
    """FlashInfer's CUDA-graph-mode prefix pass (base-2 log-sum-exp) merged with the tree pass
    equals one-pass attention; planned again for new lengths, and replayed inside a CUDA graph."""
    from heterospec.models.attention import (FlashInferPrefixPass, SdpaAttention, SplitTreeAttention,
                                             flashinfer_available)

    if not flashinfer_available():
        pytest.skip("flashinfer is not installed")
    q, cache, tree_mask, prefix = _random_tree_case(D=64, dtype=dtype)
    dev = torch.device("cuda")
    q, tree_mask, prefix = q.to(dev), tree_mask.to(dev), prefix.to(dev)
    cache.k, cache.v = cache.k.to(dev), cache.v.to(dev)
    B, T, Hq, D = q.shape
    scale = D ** -0.5
    sd = SdpaAttention()
    split = SplitTreeAttention(FlashInferPrefixPass(dev, B))
    for lens in (prefix, prefix + 2):
        ref = sd.run(sd.plan(tree_mask, lens, cache, Hq, scale), q, cache.k[0], cache.v[0])
        split.host_plan(lens.tolist(), T, Hq, cache, scale)
        out = split.run(split.plan(tree_mask, lens, cache, Hq, scale), q, cache.k[0], cache.v[0])
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    # captured once, replayed after a host plan for other lengths
    lens_buf = prefix.clone()
    split.host_plan(lens_buf.tolist(), T, Hq, cache, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = split.run(split.plan(tree_mask, lens_buf, cache, Hq, scale), q, cache.k[0], cache.v[0])
    lens_buf += 3
    split.host_plan(lens_buf.tolist(), T, Hq, cache, scale)
    graph.replay()
    ref = sd.run(sd.plan(tree_mask, lens_buf, cache, Hq, scale), q, cache.k[0], cache.v[0])
    torch.testing.assert_close(captured.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_emulation_refuses_what_a_cuda_graph_cannot_hold():
    """A half that builds a tensor from host data, or reads a tensor it did not read at capture."""
    g = RoundGraphs("cpu", emulate=True, capture_after=0)
    with pytest.raises(RuntimeError, match="builds a tensor from host data"):
        g.run("h2d", lambda x: [x + torch.tensor([1.0])], [torch.zeros(1)])
    live = {"t": torch.ones(1)}
    g.run("live", lambda x: [x + live["t"]], [torch.zeros(1)])
    old = live["t"]
    live["t"] = torch.full((1,), 2.0)            # rebound: a real graph would still read the old one
    with pytest.raises(RuntimeError, match="did not read when it was captured"):
        g.run("live", lambda x: [x + live["t"]], [torch.zeros(1)])
    # ... and once the old one is gone, the graph would read freed memory
    del old
    with pytest.raises(RuntimeError, match="freed since its capture"):
        g.run("live", lambda x: [x + live["t"]], [torch.zeros(1)])
    held = {"t": torch.ones(3)}
    g.run("held", lambda x: [x + held["t"]], [torch.zeros(3)])
    held["t"] = torch.full((3,), 2.0)            # the captured one dies with no one holding it
    with pytest.raises(RuntimeError, match="freed since its capture \\(shapes \\[\\[3\\]\\]\\)"):
        g.run("held", lambda x: [x + held["t"]], [torch.zeros(3)])


def test_a_plan_seen_again_as_a_new_object_is_prepared_before_capture():
    """Policies hand out new Plan objects; the capture must not be where their tensors are made."""
    class FreshPlans(Policy):
        def plan(self, batch_size, context=None):
            return Plan("mixed", decide_depth=1, entropy_k=3, edges=[1.0, 1.6], depth=[4, 2, 1], budget=[6, 4, 1])

    engine = _engine()
    ar = engine.generate_batch(PROMPTS, max_new_tokens=16, method="autoregressive", chat=False)
    out = engine.generate_batch(PROMPTS, max_new_tokens=16, method="heterospec", chat=False, policy=FreshPlans())
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    assert engine.round_graphs.counts["replayed"] > 2


def test_graphs_and_caches_serve_the_next_call():
    """A second call of the same batch size and length bucket reuses the kept (cleared) caches and
    replays the graphs the first call captured; the output stays the target's."""
    engine = _engine()
    engine.bin_graphs = False      # one graph per half: the counts below
    policy = _FixedPolicy(MIXED)
    n = 14     # fewer than COMPACT_MIN_LEFT: finished requests stay in the batch (same storage)
    ar = engine.generate_batch(PROMPTS, max_new_tokens=n, method="autoregressive", chat=False)
    first = engine.generate_batch(PROMPTS, max_new_tokens=n, method="heterospec", chat=False, policy=policy)
    counts = dict(engine.round_graphs.counts)
    kept = dict(engine._kept_caches)
    second = engine.generate_batch(PROMPTS, max_new_tokens=n, method="heterospec", chat=False, policy=policy)
    assert [r.token_ids for r in first] == [r.token_ids for r in second] == [r.token_ids for r in ar]
    assert engine._kept_caches == kept and all(c is not None for c in kept.values())
    c = engine.round_graphs.counts
    # the autoregressive call's plain step, the draft half, the verify half: an autoregressive call
    # (no draft cache) and a speculative one on the same kept caches share the graphs
    assert counts["captured"] == 3 and not counts.get("dropped"), counts
    assert c["captured"] == 3 and c["replayed"] > counts["replayed"] and not c.get("dropped"), dict(c)
    again = engine.generate_batch(PROMPTS, max_new_tokens=n, method="autoregressive", chat=False)
    assert [r.token_ids for r in again] == [r.token_ids for r in ar]
    assert engine.round_graphs.counts["captured"] == 3 and not engine.round_graphs.counts.get("dropped")
    # another batch size: new caches, the old graphs go
    engine.generate_batch(PROMPTS[:2], max_new_tokens=n, method="heterospec", chat=False, policy=policy)
    assert engine.round_graphs.counts["dropped"] == 3


class _FakeGraphWrapper:
    """FlashInfer 0.7's CUDA-graph-mode paged prefill wrapper, as far as FlashInferPrefixPass uses
    it: the row capacity is fixed at the first plan (or reserved before it), and a plan whose
    split-KV buffers (here: 1 KiB per reserved row) do not fit the workspace fails."""
    made = []

    def __init__(self, workspace, kv_layout, use_cuda_graph, backend, **bufs):
        assert use_cuda_graph and kv_layout == "NHD"
        self.workspace, self._max_total_num_rows, self.plans = workspace, None, []
        _FakeGraphWrapper.made.append(self)

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, n_heads, n_kv, D, S, **kw):
        rows = int(qo_indptr[-1])
        if self._max_total_num_rows is None:
            self._max_total_num_rows = rows
        elif rows > self._max_total_num_rows:
            raise ValueError(f"The total number of rows in qo_indptr {rows} in cuda graph mode cannot exceed "
                             f"the number of rows set during initialization {self._max_total_num_rows}.")
        if self._max_total_num_rows * 1024 > self.workspace.numel():
            raise RuntimeError("Error in function 'aligned_alloc': Buffer overflow when allocating memory for "
                               "batch_prefill_tmp_v ... Increase the workspace buffer size.")
        self.plans.append(rows)

    def run(self, q, kv, return_lse):
        return q * 0 + len(self.plans), torch.zeros(q.shape[:2])


def test_flashinfer_prefix_pass_wrappers_per_row_class(monkeypatch):
    """CPU, FlashInfer faked: a decode-sized first plan must not cap later trees (the H200 run's
    'rows in qo_indptr 16 ... cannot exceed' error), one wrapper per power-of-two row class (a
    captured graph replays with the wrapper it was planned with), and a workspace that is too
    small for a class's first plan is doubled instead of failing (the H200 run's 416 MiB
    batch_prefill_tmp_v overflow)."""
    import sys
    import types

    from heterospec.models.attention import FlashInferPrefixPass
    from heterospec.models.kv_cache import KVCache

    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper = _FakeGraphWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    _FakeGraphWrapper.made.clear()
    B = 2
    cache = KVCache(1, B, 256, 2, 8, dtype=torch.float32)
    pp = FlashInferPrefixPass("cpu", B, workspace_bytes=B * 16 * 1024)   # fits row class 16 only
    assert [pp.row_class(t) for t in (1, 16, 17, 60, 62, 64, 65)] == [16, 16, 32, 64, 64, 64, 128]
    pp.host_plan([5, 7], 1, 4, cache, 1.0)        # a decode step first
    w16 = pp._wrappers[16]
    pp.host_plan([5, 7], 60, 4, cache, 1.0)       # then a 60-node tree: its own wrapper, workspace x4
    w64 = pp._wrappers[64]
    assert w64 is not w16 and w64._max_total_num_rows == B * 64 and w16._max_total_num_rows == B * 16
    assert pp._workspace.numel() == 4 * B * 16 * 1024 and w64.workspace is pp._workspace
    assert w16.workspace.numel() == B * 16 * 1024      # the first wrapper keeps its own workspace
    pp.host_plan([6, 9], 62, 4, cache, 1.0)       # same class: same wrapper, re-planned
    pp.host_plan([6, 9], 4, 4, cache, 1.0)
    assert pp._wrappers == {16: w16, 64: w64} and w64.plans == [B * 60, B * 62] and w16.plans == [B, B * 4]
    o, _ = pp.run(torch.ones(B, 62, 4, 8), None, None)
    assert float(o[0, 0, 0, 0]) == 2.0            # ran by the 64-row wrapper (2 plans)
    with pytest.raises(RuntimeError, match="host_plan a \\[2, 100\\] tree"):
        pp.run(torch.ones(B, 100, 4, 8), None, None)
    with pytest.raises(ValueError, match="built for batch 2"):
        pp.host_plan([5], 4, 4, cache, 1.0)
    with pytest.raises(ValueError, match="do not fit a cache of 256"):
        pp.host_plan([250, 7], 16, 4, cache, 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flashinfer_prefix_pass_two_tree_sizes_replayed_on_cuda():
    """Graphs captured for two tree sizes with one prefix pass, then replayed alternately, each
    after its host plan: both equal one-pass attention (the engine switches T between rounds)."""
    from heterospec.models.attention import (FlashInferPrefixPass, SdpaAttention, SplitTreeAttention,
                                             flashinfer_available)

    if not flashinfer_available():
        pytest.skip("flashinfer is not installed")
    dev = torch.device("cuda")
    B, S = 3, 200
    split = SplitTreeAttention(FlashInferPrefixPass(dev, B))
    sd = SdpaAttention()
    cases = {}
    for T in (5, 40):
        q, cache, tree_mask, prefix = _random_tree_case(B=B, T=T, S=S, D=64, dtype=torch.bfloat16, seed=T)
        q, tree_mask, lens = q.to(dev), tree_mask.to(dev), prefix.to(dev).clone()
        cache.k, cache.v = cache.k.to(dev), cache.v.to(dev)
        scale = 64 ** -0.5
        split.host_plan(lens.tolist(), T, 4, cache, scale)
        split.run(split.plan(tree_mask, lens, cache, 4, scale), q, cache.k[0], cache.v[0])   # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = split.run(split.plan(tree_mask, lens, cache, 4, scale), q, cache.k[0], cache.v[0])
        cases[T] = (graph, out, q, cache, tree_mask, lens, scale)
    for step in range(4):
        for T, (graph, out, q, cache, tree_mask, lens, scale) in cases.items():
            lens += 1 + step
            split.host_plan(lens.tolist(), T, 4, cache, scale)
            graph.replay()
            ref = sd.run(sd.plan(tree_mask, lens, cache, 4, scale), q, cache.k[0], cache.v[0])
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


class _AlternatingPolicy(Policy):
    """Two plans of different depth, round after round: two draft graphs live at once, each over
    a tree-buffer shape of its own (capacity = deepest depth x top_k)."""
    def __init__(self):
        self.n = 0

    def plan(self, batch_size, context=None):
        self.n += 1
        if self.n % 2:
            return Plan("deep", decide_depth=1, entropy_k=3, edges=[1.0], depth=[7, 6], budget=[8, 7])
        return Plan("shallow", decide_depth=1, entropy_k=3, edges=[1.0], depth=[1, 1], budget=[3, 2])


@pytest.mark.parametrize("split", [False, True])
def test_draft_tree_buffers_outlive_the_graphs_that_use_them(split):
    """The static tree layout (CUDA's; forced here on CPU) recycles the draft's tree buffers per
    shape. It once kept only the latest shape's: with two plans alternating, the first plan's
    graph replayed into buffers freed when the second plan's were made - on an H200 a use-after-
    free (26 Nov: an illegal memory access in the end-to-end run). The emulation now refuses a
    replay whose captured reads were freed, so this fails if the draft drops buffers a live graph
    still uses. Split rounds size every plan's buffers for the deepest plan so far (the
    envelope): the two plans then share one buffer set."""
    engine = _engine()
    engine.bin_graphs = split
    engine.draft.kernel_friendly_attention = True          # the static tree layout, as on CUDA
    ar = engine.generate_batch(PROMPTS, max_new_tokens=24, method="autoregressive", chat=False)
    out = engine.generate_batch(PROMPTS, max_new_tokens=24, method="heterospec", chat=False,
                                policy=_AlternatingPolicy())
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    c = engine.round_graphs.counts
    assert c["captured"] >= 4 and c["replayed"] > c["captured"], dict(c)
    assert len(engine.draft._tree_pool) == (1 if split else 2)   # one buffer set per live shape
    # a new batch (new caches): the graphs go, and with them every tree buffer but the latest
    engine.generate_batch(PROMPTS[:2], max_new_tokens=8, method="heterospec", chat=False,
                          policy=_FixedPolicy(MIXED))
    assert len(engine.draft._tree_pool) == 1


def test_a_flashinfer_target_replays_with_sdpa_or_split_attention():
    """A FlashInfer target's custom-mask plan cannot be captured: replayed forwards attend with
    SDPA (``graph_attention="sdpa"``, the default) or in two passes (``"split"``). Here a stand-in
    backend named "flashinfer" (SDPA underneath) takes FlashInfer's place on CPU."""
    from heterospec.models.attention import SdpaAttention, SplitTreeAttention, TorchPrefixPass

    class StandIn(SdpaAttention):
        name = "flashinfer"

    ar = _engine(graphs=False).generate_batch(PROMPTS, max_new_tokens=16, method="autoregressive", chat=False)
    for mode in ("sdpa", "split"):
        engine = _engine()
        engine.target._backend = StandIn()
        engine.graph_attention = mode
        if mode == "split":   # the FlashInfer prefix pass needs CUDA: the torch one stands in
            engine.split_attention_factory = lambda B: SplitTreeAttention(TorchPrefixPass())
        out = engine.generate_batch(PROMPTS, max_new_tokens=16, method="eagle3", chat=False)
        assert [r.token_ids for r in out] == [r.token_ids for r in ar], mode
        assert engine.round_graphs.counts["replayed"] > 4, dict(engine.round_graphs.counts)
        assert (engine._graph_sdpa is not None) == (mode == "sdpa") and bool(engine._split) == (mode == "split")
    # switching back and forth: each mode attends its own way (nothing of "split" sticks)
    engine = _engine()
    engine.target._backend = StandIn()
    made = []
    engine._flashinfer_split = lambda B: made.append(B) or SplitTreeAttention(TorchPrefixPass())
    for mode in ("split", "sdpa", "split"):
        engine.graph_attention = mode
        _, attn = engine._target_graphs(engine._prefill([PROMPTS[0]], "autoregressive", heterospec.SamplingParams(),
                                                        None, 16, 4, None), 1)
        assert isinstance(attn, SplitTreeAttention) == (mode == "split"), mode
    assert made == [1]                        # one split attention per batch size, made once
    engine = _engine()
    engine.graph_attention = "flashinfer"
    with pytest.raises(ValueError, match="graph_attention must be 'sdpa' or 'split'"):
        engine.generate_batch(PROMPTS, max_new_tokens=4, method="eagle3", chat=False)


def test_e2e_reports_the_graph_events_of_its_timed_runs(tmp_path):
    """With CUDA graphs (emulated) run_e2e warms each method up for longer and reports, per
    method, the first runs / captures / replays that its timed runs still made."""
    from heterospec.bench import run_e2e
    from heterospec.datasets import Prompt

    engine = _engine()
    engine.tokenizer = None
    sets = {"toy": [Prompt(id="a", text=[5, 9, 17, 33], source="toy"), Prompt(id="b", text=[7, 8, 9], source="toy")]}
    calls = []
    generate = engine.generate
    engine.generate = lambda prompt, **kw: calls.append((prompt, kw.get("max_new_tokens"))) or generate(prompt, **kw)
    res = run_e2e(engine, sets, n=2, max_new_tokens=12, out_dir=str(tmp_path), methods=("autoregressive", "eagle3"),
                  progress=False)
    # the warm-up (one call a method before the timed ones) runs at the timed length
    assert calls[:2] == [([5, 9, 17, 33], 12)] * 2
    totals = res["meta"]["graphs_in_timed_runs"]
    assert totals and totals["eagle3"].get("replayed", 0) > 0 and totals["autoregressive"].get("replayed", 0) > 0
    assert all("graphs" in r for r in res["runs"])
    assert "CUDA graphs in the timed runs" in (tmp_path / "e2e.md").read_text()


def test_e2e_warm_up_reaches_the_longest_timed_prompt():
    """With CUDA graphs a call that outgrows the kept KV caches reallocates them and captures its
    graphs again: run_e2e adds a warm-up request (our own text) at least as long as the longest
    timed prompt, so the timed calls replay."""
    from heterospec.bench import WARMUP_PROMPTS, _warmup_as_long_as

    class Words:
        def _encode(self, text, chat):
            assert chat
            return text.split()

    timed = ["a short one", "word " * 300]
    text = _warmup_as_long_as(Words(), timed)
    assert len(text.split()) >= 300
    assert text.startswith(WARMUP_PROMPTS[0]) and "word" not in text.split()   # ours, none of the timed text
    assert len(_warmup_as_long_as(Words(), ["a short one"]).split()) == len(" ".join(WARMUP_PROMPTS).split())
