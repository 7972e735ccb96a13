"""Context lookup (heterospec.lookup): the n-gram index against a brute-force reference, the
gate's choice against the known optimum of synthetic acceptance and cost, and lookup rounds in
the engine - greedy output identical to autoregressive's at batch 1 and in batches whose requests
verify chains of different lengths, mixed with drafted trees and plain steps; sampling keeps the
target's law."""

import math
import random

import pytest
import torch

from heterospec import Engine, SpecConfig
from heterospec.config import SamplingParams
from heterospec.lookup import (CORPUS_SOURCE, HISTORY_ROW, MATCH_BUCKETS, ContextIndex, LookupGate, LookupRound, OutputHistory,
                               match_bucket, proposal_row)
from heterospec.policy import FittedPolicy, Plan
from tests.engine_util import OracleDraft, tiny_hf_llama
from tests.test_policy import DEPTHS, NODES, LinearCost, _tables


def reference_propose(tokens, k, nmax):
    """The longest suffix (n <= nmax) with an earlier occurrence whose continuation is known;
    its latest such occurrence; the tokens after it, continued as a loop where they run out."""
    L = len(tokens)
    for n in range(min(nmax, L - 1), 0, -1):
        starts = [i for i in range(0, L - n) if tokens[i:i + n] == tokens[L - n:]]
        if starts:
            s = max(starts) + n
            period = L - s
            return [tokens[s + j] if s + j < L else tokens[s + (j - period) % period] for j in range(k)], n
    return [], 0


@pytest.mark.parametrize("vocab", [2, 3, 7])
def test_context_index_proposes_what_the_reference_finds(vocab):
    rng = random.Random(vocab)
    for trial in range(60):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        nmax = rng.choice([1, 3, 8])
        index = ContextIndex(tokens[:len(tokens) // 2], nmax=nmax)
        index.extend(tokens[len(tokens) // 2:])            # grown in two parts, as the engine does
        for k in (1, 4, 9):
            assert index.propose(k) == reference_propose(tokens, k, nmax), (tokens, nmax, k)


def test_context_index_continues_a_loop_and_rejects_bad_settings():
    assert ContextIndex([4, 7, 7, 7]).propose(5) == ([7, 7, 7, 7, 7], 2)
    assert ContextIndex([1, 2, 3, 1, 2]).propose(5) == ([3, 1, 2, 3, 1], 2)
    assert ContextIndex([1, 2, 3]).propose(3) == ([], 0)
    with pytest.raises(ValueError, match="nmax"):
        ContextIndex([1], nmax=0)
    with pytest.raises(ValueError, match="kmax"):
        LookupGate(kmax=0)
    assert [match_bucket(n) for n in (1, 2, 3, 4, 7, 8, 30)] == [0, 1, 2, 3, 3, 4, 4]


def _taught(gate, bucket, p, rounds=4000, seed=0):
    """Feed ``gate`` lookup rounds of ``bucket`` whose every token is accepted with probability ``p``."""
    rng = random.Random(seed)
    for _ in range(rounds):
        chain = [1] * gate.kmax
        a = 0
        while a < len(chain) and rng.random() < p:
            a += 1
        gate.observe(LookupRound([chain], [bucket], 1.0, 1.0), [a], None)
    return gate


def test_gate_learns_per_position_acceptance():
    gate = _taught(LookupGate(kmax=4), match_bucket(8), 0.8)
    assert gate.accept(match_bucket(8)) == pytest.approx([0.8] * 4, abs=0.05)
    assert gate.accept(match_bucket(1)) == pytest.approx([LookupGate.PRIOR] * 4)


def _brute_force(gate, proposals, verify_ms, room):
    """The best rate over every combination of per-request chain prefixes."""
    import itertools
    running = [b for b, r in enumerate(room) if r > 0]
    limits = [min(len(proposals[b][0]), gate.kmax, room[b] - 1) if proposals[b][1] else 0 for b in running]
    best = None
    for ks in itertools.product(*[range(lim + 1) for lim in limits]):
        tokens = sum(1 + (gate.expected_accepted(match_bucket(proposals[b][1]), k)[k] if k else 0)
                     for b, k in zip(running, ks))
        ms = verify_ms(1 + sum(ks) / len(running), 1 + max(ks))
        if best is None or 1e3 * tokens / ms > best[0] + 1e-9:
            best = (1e3 * tokens / ms, dict(zip(running, ks)))
    return best


@pytest.mark.parametrize("slope", [0.05, 0.3, 1.5, 4.0])
def test_gate_picks_the_known_optimum_and_declines_when_plain_is_faster(slope):
    gate = _taught(_taught(LookupGate(kmax=6), match_bucket(8), 0.9), match_bucket(2), 0.4, seed=1)
    proposals = [([5] * 6, 9), ([3] * 6, 2), ([], 0), ([1] * 6, 8), ([2] * 5, 1)]
    room = [100, 100, 100, 3, 100]
    B = len(room)

    def verify_ms(mean, most):          # ragged: 10 ms for the roots, slope per extra row of the batch
        return 10.0 + slope * B * (mean - 1)

    rate, ks = _brute_force(gate, proposals, verify_ms, room)
    plain_rate = 1e3 * B / 10.0
    chosen = gate.choose(proposals, verify_ms, 0.0, room)
    if not any(ks.values()):             # roots only is best: no lookup round, whatever plain steps cost
        assert chosen is None and slope >= 1.5
        return
    assert 1e3 * chosen.expected_tokens / chosen.predicted_ms == pytest.approx(rate)
    assert [len(c) for c in chosen.chains] == [ks.get(b, 0) for b in range(B)]
    assert chosen.buckets == [match_bucket(n) if ks.get(b) else -1 for b, (_, n) in enumerate(proposals)]
    assert len(chosen.chains[3]) <= 2                         # room 3: two tokens and the bonus
    if slope >= 1.5:     # a weak match (bucket of n = 1, untaught: the prior) is not worth a row there
        assert chosen.chains[4] == [] or len(chosen.chains[4]) < len(chosen.chains[0])
    # against plain steps: chosen exactly when it beats them by the gate's margin
    chosen = gate.choose(proposals, verify_ms, plain_rate, room)
    assert (chosen is not None) == (rate >= LookupGate.MARGIN * plain_rate)
    # finished requests (room 0) are neither counted nor given a chain
    only = gate.choose([([5] * 6, 9), ([5] * 6, 9)], verify_ms, 0.0, [0, 100])
    assert only.chains[0] == [] and only.buckets[0] == -1 and only.chains[1]
    assert gate.choose([([], 0), ([], 0)], verify_ms, 0.0) is None


def test_gate_counts_a_stall_as_stall_factor_times_its_prediction():
    """A plain step or lookup round timed far above its prediction counts as STALL_FACTOR times
    it (times the scale measured so far): one 50x step among steps as predicted leaves the
    gate's time scale near 1."""
    from heterospec.timing import STALL_FACTOR
    gate = LookupGate(kmax=6)
    for x in (1.0, 1.0, 50.0, 1.0):
        gate.observe_plain(1e-3 * 10.0 * x, 10.0)
    f = gate.TIME_FORGET
    want = (f ** 3 + f ** 2 + f * STALL_FACTOR + 1.0) / (f ** 3 + f ** 2 + f + 1.0)
    assert gate.time_scale(1, "plain") == pytest.approx(want) and want < 1.6
    slow = LookupGate(kmax=6)            # a device measured 2x slower keeps rounds up to 6x
    for x in (2.0, 2.0, 5.0):
        slow.observe_plain(1e-3 * 10.0 * x, 10.0)
    assert slow.time_scale(1, "plain") == pytest.approx((2 * f * f + 2 * f + 5) / (f * f + f + 1))


def _slowest_progress(gate, proposals, ks, lead, room, simulate=0):
    """E[how far a round moves the slowest running request], each request verifying the first
    ``ks[b]`` tokens of its chain (independent acceptances at the gate's per-position
    probabilities): exactly, as 1 + sum over j >= 1 of P(every request ends >= j beyond a plain
    step), or by ``simulate`` draws."""
    running = [b for b, r in enumerate(room) if r > 0]
    probs = {b: gate.accept(proposal_row(proposals[b])) if proposals[b][1] else [] for b in running}
    if simulate:
        rng, total = random.Random(7), 0.0
        for _ in range(simulate):
            moved = []
            for b in running:
                a = 0
                while a < ks.get(b, 0) and rng.random() < probs[b][a]:
                    a += 1
                if 1 + a < room[b]:            # (a request that emitted all its room has ended)
                    moved.append(lead[b] + 1 + a)
            total += min(moved) if moved else 1 + max(ks.values())
        return total / simulate
    expected, j = 1.0, 1
    while True:
        p = 1.0
        for b in running:
            need = min(j - lead[b], room[b] - 1)   # tokens b must accept for the slowest to end j
            if need > ks.get(b, 0):                 # further (or, with less room, to end itself)
                p = 0.0
            elif need > 0:
                p *= math.prod(probs[b][:need])
        if p == 0.0:
            return expected
        expected, j = expected + p, j + 1


def test_slowest_progress_reference_agrees_with_a_simulation():
    gate = _taught(LookupGate(kmax=4), match_bucket(8), 0.8)
    props, lead, ks = [([1] * 4, 8)] * 3, [0, 1, 0], {0: 3, 1: 2, 2: 4}
    for room in ([9] * 3, [9, 2, 9]):          # (room 2: request 1 ends once it accepts one token)
        exact = _slowest_progress(gate, props, ks, lead, room)
        assert exact == pytest.approx(_slowest_progress(gate, props, ks, lead, room, simulate=40000), abs=0.02)
        assert 1.5 < exact < 3.0


@pytest.mark.parametrize("slope", [0.05, 0.5, 3.0])
@pytest.mark.parametrize("case", ["all-matched", "one-unmatched", "ahead-unmatched", "ahead-matched",
                                  "ending-unmatched"])
def test_gate_in_a_static_batch_prices_the_slowest_request(slope, case):
    """With ``lead`` (a static batch) a round is worth how far it moves the slowest request: the
    gate's choice maximises that rate over every combination of chain prefixes (brute force,
    simulated), a behind request without a chain makes every lookup worthless, and a request
    one token ahead without a chain caps the round at one token beyond a plain step."""
    import itertools
    gate = _taught(_taught(LookupGate(kmax=4), match_bucket(8), 0.9), match_bucket(2), 0.6, seed=1)
    chains = {"all-matched": [([5] * 4, 9), ([3] * 4, 2), ([1] * 4, 8)],
              "one-unmatched": [([5] * 4, 9), ([], 0), ([1] * 4, 8)],
              "ahead-unmatched": [([5] * 4, 9), ([], 0), ([1] * 4, 8)],
              "ahead-matched": [([5] * 4, 9), ([3] * 4, 2), ([1] * 4, 8)],
              "ending-unmatched": [([5] * 4, 9), ([], 0), ([1] * 4, 8)]}[case]
    lead = {"all-matched": [0, 0, 0], "one-unmatched": [0, 0, 0], "ahead-unmatched": [0, 1, 0],
            "ahead-matched": [0, 2, 0], "ending-unmatched": [0, 0, 0]}[case]
    # the request without a chain ends with this round's bonus: it does not hold the batch
    room, B = ([100, 1, 100] if case == "ending-unmatched" else [100] * 3), 3

    def verify_ms(mean, most):
        return 10.0 + slope * B * (mean - 1)

    chosen = gate.choose(chains, verify_ms, 0.0, room, lead=lead)
    if case == "one-unmatched":
        assert chosen is None
        return
    best = None
    for ks in itertools.product(*[range(min(len(c), gate.kmax, r - 1) + 1) for (c, _), r in zip(chains, room)]):
        ks = dict(enumerate(ks))
        rate = 1e3 * B * _slowest_progress(gate, chains, ks, lead, room) / verify_ms(1 + sum(ks.values()) / B,
                                                                                      1 + max(ks.values()))
        if best is None or rate > best[0]:
            best = (rate, ks)
    plain = 1e3 * B / verify_ms(1.0, 1)
    if chosen is None:
        assert best[0] <= plain * 1.01          # (the simulation's noise)
        return
    got = 1e3 * B * _slowest_progress(gate, chains, {b: len(c) for b, c in enumerate(chosen.chains)}, lead, room) \
        / verify_ms(1 + sum(len(c) for c in chosen.chains) / B, 1 + max(len(c) for c in chosen.chains))
    assert got == pytest.approx(best[0], rel=0.02)
    assert 1e3 * chosen.expected_tokens / chosen.model_ms == pytest.approx(got, rel=0.02)   # its own price
    if case == "ahead-unmatched":                # the request one ahead bounds the round at 2 tokens
        assert chosen.chains[1] == [] and max(len(c) for c in chosen.chains) <= 1
    if case == "ahead-matched":                  # two ahead: it verifies only from level 3 on
        assert len(chosen.chains[1]) == max(0, len(chosen.chains[0]) - 2)
    if case == "ending-unmatched":
        assert chosen.chains[0] and chosen.chains[2] and chosen.chains[1] == []


def test_gate_retries_a_bucket_after_an_unlucky_round():
    """One round of a match bucket accepting nothing stops its lookups; its counts fade in the
    rounds it proposes and is not verified (IDLE_FORGET), so it is tried again later."""
    gate, n = LookupGate(kmax=4), match_bucket(8)
    proposals = [([5] * 4, 8)] * 4

    def verify_ms(mean, most):
        return 10.0 + 0.5 * 4 * (mean - 1)
    plain = 1e3 * 4 / 10.0
    first = gate.choose(proposals, verify_ms, plain)            # the prior pays
    assert first is not None and all(first.chains)
    gate.observe(first, [0] * 4, None)                           # none accepted
    assert gate.accept(n)[0] < 0.2
    rounds = 1
    while gate.choose(proposals, verify_ms, plain) is None:
        rounds += 1
        assert rounds < 1000
    assert 20 < rounds < 200                                     # (~49 at IDLE_FORGET 0.99)
    taught = _taught(LookupGate(kmax=4), n, 0.05)               # a bucket that keeps losing stays off for longer
    assert all(taught.choose(proposals, verify_ms, plain) is None for _ in range(rounds))


def test_gate_prices_lookup_rounds_by_what_they_measured():
    gate = LookupGate()
    assert gate.time_scale() == 1.0
    gate.observe_plain(0.012, 10.0)                     # before any lookup round: plain steps' scale
    assert gate.time_scale() == pytest.approx(1.2)
    for _ in range(50):
        gate.observe_plain(0.010, 10.0)
        gate.observe(LookupRound([[1]], [0], 12.0, 2.0), [1], 0.018)   # lookup: 1.5x its prediction
        gate.observe(LookupRound([[1]], [0], 12.0, 2.0, batch_bucket=8), [1], 0.024)
    # (shrunk a little towards the plain steps' 1.0: TIME_PRIOR_STEPS)
    assert gate.time_scale() == pytest.approx(1.5, rel=0.03) and gate.time_scale() < 1.5
    assert gate.time_scale(8) == pytest.approx(2.0, rel=0.01) and gate.time_scale(4) == 1.0
    # the price of the next round includes it
    chosen = gate.choose([([1, 2], 8)], lambda mean, most: 10.0 + 0.1 * (mean - 1), 0.0, batch_bucket=8)
    assert chosen.predicted_ms == pytest.approx(2.0 * chosen.model_ms, rel=0.01)


def test_a_lookup_scale_a_stall_inflated_returns_to_the_plain_steps():
    """Lookup rounds timed during a stall of the machine (at the stall cap, round after round)
    price later chains high; with no lookup round taken since, the plain steps that run instead
    fade that evidence, and the scale returns to the plain steps' within about a prompt
    (TIME_IDLE_FORGET), so chains are tried, and measured, again."""
    gate = LookupGate()
    for _ in range(30):                                  # a steady run: lookup rounds 1.2x, plain 1.0x
        gate.observe_plain(0.010, 10.0)
        gate.observe_plain(0.010, 10.0)
        gate.observe(LookupRound([[1, 2]], [0], 15.0, 15.0), [2], 0.018)
    assert gate.time_scale() == pytest.approx(1.2, rel=0.03)
    for _ in range(5):                                   # a stall: 6-12x, each counted at the cap
        gate.observe(LookupRound([[1, 2]], [0], 15.0, 15.0), [2], 0.150)
    stalled = gate.time_scale()
    assert stalled > 2.5
    assert gate.choose([([1, 2, 3], 8)], lambda mean, most: 10.0 + 2.5 * (mean - 1), 1e3 / 10.0) is None
    steps = 0
    while gate.time_scale() > 1.1 and steps < 1000:
        gate.observe_plain(0.010, 10.0)
        steps += 1
    assert steps < 100
    assert gate.choose([([1, 2, 3], 8)], lambda mean, most: 10.0 + 2.5 * (mean - 1), 1e3 / 10.0) is not None


# ---------------------------------------------------------------------------------------------
# In the engine
# ---------------------------------------------------------------------------------------------
class ForcedGate(LookupGate):
    """A gate that verifies every proposal (up to ``k`` tokens) in rounds where ``when(n)`` is
    true (n counts the calls), and leaves the others to the policy."""

    def __init__(self, k, when=lambda n: True):
        super().__init__(kmax=k)
        self.when, self.n, self.rounds = when, 0, 0

    def holds_batch(self, proposal, lead, room):
        return False          # every round it is asked in verifies what was proposed

    def choose(self, proposals, verify_ms, alternative_tokens_per_s, room=None, batch_bucket=1, lead=None):
        self.n += 1
        if not self.when(self.n):
            return None
        chains = [p[0][:max(min(self.kmax, (room[b] if room else 99) - 1), 0)] for b, p in enumerate(proposals)]
        if not any(chains):
            return None
        self.rounds += 1
        return LookupRound(chains, [proposal_row(p) if c else -1 for c, p in zip(chains, proposals)], 1.0, 1.0)


class ScriptedFitted(FittedPolicy):
    """A fitted policy (so the engine consults the lookup gate) whose rounds follow a script:
    round n (from 1) is ``rounds(n)``."""

    def __init__(self, config, rounds):
        super().__init__(_tables(), LinearCost(), config)
        self.rounds, self.n = rounds, 0

    def plan(self, batch_size, context=None):
        return self.rounds(max(self.n, 1))

    def needs_draft(self, batch_size):
        return True

    def round_plan(self, batch_size, context=None, tokens_left=None, catchup=None, timed=True):
        self.n += 1
        return self.rounds(self.n)

    def observe(self, *args, **kwargs):
        pass

    def save_state(self):
        pass


CFG = SpecConfig(top_k=4, depth=1, total_tokens=4)
SPEC = Plan("spec", decide_depth=1, entropy_k=4, edges=[], depth=[2], budget=[4])
PLAIN = Plan("plain", speculate=False, decide_depth=0, entropy_k=4, edges=[], depth=[0], budget=[0], binned=False)


def _repetitive_prompts(vocab, n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        motif = torch.randint(0, vocab, (3 + i % 3,), generator=g).tolist()
        out.append((motif * 4)[: 7 + 2 * i])          # different lengths, plenty to copy
    return out


@pytest.mark.parametrize("batch", [1, 4])
def test_lookup_rounds_mixed_with_trees_and_plain_steps_are_greedy_lossless(batch):
    hf = tiny_hf_llama(seed=11, vocab=16)   # its greedy text falls into loops: lookup chains are accepted
    draft = OracleDraft(hf, noise=0.8, seed=5)
    engine = Engine(hf, draft, config=CFG)
    engine.target.config.eos_token_ids = ()     # 40 tokens each: time to fall into a loop
    prompts = _repetitive_prompts(hf.config.vocab_size, batch, seed=batch)
    draft.set_prompts(prompts)
    ar = engine.generate_batch(prompts, max_new_tokens=40, method="autoregressive", chat=False)
    # rounds: lookup, tree, plain, lookup, lookup, tree ... (the gate's turn comes first)
    engine.lookup_gate = ForcedGate(5, when=lambda n: n % 3 != 2)
    script = ScriptedFitted(CFG, lambda n: SPEC if n % 2 else PLAIN)
    draft.set_prompts(prompts)
    hs = engine.generate_batch(prompts, max_new_tokens=40, method="heterospec", policy=script, config=CFG,
                               chat=False)
    assert [r.token_ids for r in hs] == [r.token_ids for r in ar]
    recs = [r for x in hs for r in x.stats.records]
    assert any(r.lookup and r.accept_len > 0 for r in recs)
    assert any(r.lookup and r.verified > 1 and r.accept_len < r.verified - 1 for r in recs)   # rejections too
    assert any(not r.lookup and not r.plain and r.accept_len > 0 for r in recs)               # drafted trees
    assert any(r.plain for r in recs)
    # the same calls without lookup, and with the engine's own gate: the same tokens
    for lookup in (False, None):
        engine.lookup_gate = LookupGate()
        draft.set_prompts(prompts)
        out = engine.generate_batch(prompts, max_new_tokens=40, method="heterospec", config=CFG, chat=False,
                                    policy=ScriptedFitted(CFG, lambda n: SPEC if n % 2 else PLAIN), lookup=lookup)
        assert [r.token_ids for r in out] == [r.token_ids for r in ar]
        assert lookup is not False or not any(r.lookup for x in out for r in x.stats.records)


def test_lookup_is_only_for_the_fitted_policy_and_can_be_turned_off():
    hf = tiny_hf_llama(seed=54)
    draft = OracleDraft(hf, noise=0.8, seed=5)
    prompts = _repetitive_prompts(hf.config.vocab_size, 2, seed=3)
    engine = Engine(hf, draft, config=CFG, lookup=False)
    assert engine.lookup_gate is None
    engine.lookup_gate = ForcedGate(4)
    for method in ("eagle3", "heterospec"):            # eagle3; heterospec without tables: the paper's policy
        draft.set_prompts(prompts)
        with pytest.warns(UserWarning) if method == "heterospec" else _nothing():
            res = engine.generate_batch(prompts, max_new_tokens=12, method=method, chat=False)
        assert not any(r.lookup for x in res for r in x.stats.records)
    # an engine built without lookup: a call may still ask for it (the engine's setting stays off)
    engine.lookup_gate = None
    draft.set_prompts(prompts)
    res = engine.generate_batch(prompts, max_new_tokens=12, method="heterospec", config=CFG, chat=False,
                                policy=ScriptedFitted(CFG, lambda n: PLAIN), lookup=True)
    assert engine.lookup_gate is None and engine._call_gate is not None and len(res) == 2
    with pytest.raises(ValueError, match="lookup"):
        Engine(hf, draft, config=CFG, lookup="yes")
    with pytest.raises(ValueError, match="lookup"):
        engine.generate(prompts[0], max_new_tokens=4, chat=False, lookup=1)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class HistoryFirstGate(ForcedGate):
    """A forced gate that takes the history's chain whenever there is one."""

    def better(self, own, history=([], 0), corpus=None):
        return (history[0], history[1], True) if history[0] else own


class CorpusFirstGate(ForcedGate):
    """A forced gate that takes the lookup corpus's chain whenever there is one."""

    def better(self, own, history=([], 0), corpus=None):
        return (corpus[0], corpus[1], CORPUS_SOURCE) if corpus is not None and corpus[0] else own


def random_corpus(vocab, docs=40, length=60, seed=0):
    """A CorpusIndex of random documents over ``vocab`` tokens (every short n-gram occurs)."""
    from heterospec.datastore import SEP, CorpusIndex

    rng = random.Random(seed)
    toks = []
    for _ in range(docs):
        toks += [rng.randrange(vocab) for _ in range(length)] + [SEP]
    return CorpusIndex(toks)


@pytest.mark.parametrize("source", ["context", "history", "corpus"])
def test_lookup_rounds_keep_the_sampling_law(source):
    from tests.test_sampling_lossless import PROMPT, REQUESTS, VOCAB, _engine, assert_samples_follow_law, exact_law

    engine, hf = _engine("eagle3")
    if source == "history":
        # an earlier answer to the same prompt (allowed here), so that every request can copy from it
        engine.lookup_history = OutputHistory(same_prompt=True)
        engine.lookup_history.add(PROMPT, [2, 4, 1, 0, 3])
    if source == "corpus":
        engine.lookup_corpus = random_corpus(VOCAB, seed=3)
    gate = {"context": ForcedGate, "history": HistoryFirstGate, "corpus": CorpusFirstGate}[source]
    engine.lookup_gate = gate(2, when=lambda n: n % 2 == 1)
    params = SamplingParams(temperature=0.8, top_k=6)
    res = engine.generate_batch([PROMPT] * REQUESTS, max_new_tokens=3, method="heterospec", chat=False,
                                temperature=params.temperature, top_k=params.top_k,
                                seed={"context": 77, "history": 78, "corpus": 79}[source],
                                config=CFG, policy=ScriptedFitted(CFG, lambda n: SPEC))
    recs = [r for x in res for r in x.stats.records if getattr(r, source if source != "context" else "lookup")]
    assert len(recs) > REQUESTS // (4 if source == "context" else 10)
    assert any(r.accept_len > 0 for r in recs) and any(r.accept_len == 0 for r in recs)
    assert_samples_follow_law(res, exact_law(hf, params))


def test_gate_state_round_trips_and_a_foreign_state_is_ignored(tmp_path):
    from heterospec.engine import _lookup_state_path

    gate = _taught(LookupGate(kmax=4), match_bucket(8), 0.7)
    gate.observe_plain(0.01, 9.0)
    policy = FittedPolicy(_tables(), LinearCost(), CFG, state_path=str(tmp_path / "m.online-abc.json"))
    path = _lookup_state_path(policy)
    assert path == str(tmp_path / "m.online-abc.lookup.json")
    gate.save(path)
    again = LookupGate(kmax=4)
    again.load(path)
    assert again.accept(match_bucket(8)) == gate.accept(match_bucket(8)) and again._time == gate._time
    for bad in ({}, dict(gate.state(), kmax=5), dict(gate.state(), hit=[[9.0] * 4] * len(MATCH_BUCKETS)),
                dict(gate.state(), buckets=[1, 2]), dict(gate.state(), time={"lookup": [1, 2], "plain": [1, 2]})):
        fresh = LookupGate(kmax=4)
        assert fresh.load_state(bad) is False and fresh.accept(0) == [LookupGate.PRIOR] * 4
    (tmp_path / "junk.json").write_text("{not json")
    LookupGate().load(str(tmp_path / "junk.json"))          # ignored, no error
    assert _lookup_state_path(ScriptedFitted(CFG, lambda n: PLAIN)) is None


# ---------------------------------------------------------------------------------------------
# The output history: chains copied from earlier requests.
def reference_history(segments, context, k, nmax, skip=None):
    """The longest suffix (n <= nmax) of ``context`` that occurs inside an earlier request of
    ``segments`` [(prompt, tokens)] with a token after it, whose prompt is not ``skip``; its latest
    such occurrence; the tokens after it, up to ``k``, cut at that request's end."""
    for n in range(min(nmax, len(context)), 0, -1):
        best = None
        for si, (p, seq) in enumerate(segments):
            if skip is not None and tuple(p) == tuple(skip):
                continue
            for i in range(n, len(seq)):
                if seq[i - n:i] == list(context[len(context) - n:]):
                    best = (si, i)               # later segments and positions overwrite
        if best is not None:
            si, i = best
            return segments[si][1][i:i + k], n
    return [], 0


@pytest.mark.parametrize("vocab", [2, 4, 9])
def test_output_history_proposes_what_the_reference_finds(vocab):
    rng = random.Random(100 + vocab)
    for trial in range(40):
        nmax = rng.choice([1, 3, 8])
        same_prompt = rng.random() < 0.3
        hist = OutputHistory(nmax=nmax, same_prompt=same_prompt)
        prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 4))] for _ in range(3)]
        segments, last_of = [], {}
        for _ in range(rng.randrange(0, 6)):
            p = rng.choice(prompts)
            seq = p + [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
            hist.add(p, seq[len(p):])
            # an answer already held for its prompt is not added again; nor a single token
            if last_of.get(tuple(p)) == seq or len(seq) < 2:
                continue
            last_of[tuple(p)] = seq
            segments.append((p, seq))
        assert len(hist) == sum(len(s) for _, s in segments)
        for _ in range(6):
            req_prompt = rng.choice(prompts)
            context = req_prompt + [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
            for k in (1, 3, 8):
                skip = None if same_prompt else req_prompt
                assert hist.propose(context, k, req_prompt) == reference_history(segments, context, k, nmax, skip), \
                    (segments, context, k, nmax, same_prompt)


def test_output_history_cuts_at_a_request_end_keeps_the_newest_and_rejects_bad_settings():
    hist = OutputHistory(nmax=4)
    hist.add([1, 2], [3, 4, 5])
    hist.add([9], [3, 4, 6, 7])
    assert hist.propose([8, 3, 4], 5) == ([6, 7], 2)               # the latest occurrence, cut at its end
    assert hist.propose([8, 3, 4], 5, prompt=[9]) == ([5], 2)       # not from an answer to its own prompt
    hist.same_prompt = True
    assert hist.propose([8, 3, 4], 5, prompt=[9]) == ([6, 7], 2)
    assert hist.propose([8, 8], 3) == ([], 0) and OutputHistory().propose([1, 2], 4) == ([], 0)
    n = len(hist)
    hist.add([9], [3, 4, 6, 7])                                     # the same answer again: not added
    assert len(hist) == n
    small = OutputHistory(max_tokens=10, nmax=2)
    for i in range(6):
        small.add([100 + i], [i, i + 1, i + 2])
    assert len(small) <= 10 and small.propose([0, 5], 4) == ([6, 7], 1)     # the newest request kept
    assert small.propose([9, 0], 4) == ([], 0)                              # the oldest gone
    for bad in (dict(nmax=0), dict(max_tokens=0)):
        with pytest.raises(ValueError, match="nmax|max_tokens"):
            OutputHistory(**bad)


def test_gate_keeps_history_chains_apart_and_prefers_the_better_source():
    gate = LookupGate(kmax=4)
    assert proposal_row(([1], 3)) == match_bucket(3) and proposal_row(([1], 3, True)) == HISTORY_ROW + match_bucket(3)
    # before any evidence the request's own context wins a tie
    assert gate.better(([1, 2], 2), ([5, 6], 2)) == ([1, 2], 2)
    assert gate.better(([], 0), ([5, 6], 2)) == ([5, 6], 2, True)
    assert gate.better(([1, 2], 2), ([], 0)) == ([1, 2], 2)
    _taught(gate, HISTORY_ROW + match_bucket(2), 0.9)
    _taught(gate, match_bucket(2), 0.2, seed=1)
    assert gate.better(([1, 2, 3, 4], 2), ([5, 6, 7, 8], 2)) == ([5, 6, 7, 8], 2, True)
    assert gate.accept(match_bucket(2))[0] == pytest.approx(0.2, abs=0.05)
    assert gate.accept(HISTORY_ROW + match_bucket(2))[0] == pytest.approx(0.9, abs=0.05)
    # a round of history chains is recorded under the history's rows
    cost = lambda mean, most: 10.0 + 0.1 * most
    r = gate.choose([([5, 6, 7, 8], 2, True)], cost, 50.0)
    assert r is not None and r.buckets == [HISTORY_ROW + match_bucket(2)] and len(r.chains[0]) >= 2
    # a state saved before the history's rows is taken up, the history's rows at the prior
    old = {"kmax": 4, "buckets": list(MATCH_BUCKETS), "tried": [[2.0] * 4] * len(MATCH_BUCKETS),
           "hit": [[2.0] * 4] * len(MATCH_BUCKETS), "time": {"lookup": {}, "plain": {}}}
    fresh = LookupGate(kmax=4)
    assert fresh.load_state(old) is True
    assert fresh.accept(HISTORY_ROW)[0] == LookupGate.PRIOR and fresh.accept(0)[0] != LookupGate.PRIOR
    assert fresh.load_state(dict(gate.state(), sources=["context"])) is False


def forced_lookup_run(engine, draft, prompts, gate, **kwargs):
    """HeteroSpec on ``prompts`` (30 tokens) with a ``gate`` (a ForcedGate) that verifies what was
    proposed in 2 rounds of 3, and a plan of drafted trees and plain steps in turn."""
    engine.lookup_gate = gate(5, when=lambda n: n % 3 != 2)
    draft.set_prompts(prompts)
    return engine.generate_batch(prompts, max_new_tokens=30, method="heterospec", chat=False, config=CFG,
                                 policy=ScriptedFitted(CFG, lambda n: SPEC if n % 2 else PLAIN), **kwargs)


@pytest.mark.parametrize("batch", [1, 3])
def test_history_chains_are_greedy_lossless(batch):
    hf = tiny_hf_llama(seed=11, vocab=16)
    draft = OracleDraft(hf, noise=0.8, seed=5)
    engine = Engine(hf, draft, config=CFG)
    assert engine.lookup_history is None                # opted into
    engine.lookup_history = OutputHistory()
    engine.target.config.eos_token_ids = ()
    earlier = _repetitive_prompts(hf.config.vocab_size, batch, seed=batch + 20)
    engine.generate_batch(earlier, max_new_tokens=30, method="autoregressive", chat=False)
    assert len(engine.lookup_history) == 0          # a call that does not look up does not feed it
    draft.set_prompts(earlier)
    engine.generate_batch(earlier, max_new_tokens=30, method="heterospec", chat=False, config=CFG,
                          policy=ScriptedFitted(CFG, lambda n: PLAIN))             # fills the history
    assert len(engine.lookup_history) > 0
    # new prompts that end as the earlier ones did (another prompt each: their answers may be copied)
    prompts = [[15 - i] + p for i, p in enumerate(earlier)]
    ar = engine.generate_batch(prompts, max_new_tokens=30, method="autoregressive", chat=False)
    hs = forced_lookup_run(engine, draft, prompts, HistoryFirstGate)
    assert [r.token_ids for r in hs] == [r.token_ids for r in ar]
    recs = [r for x in hs for r in x.stats.records]
    assert any(r.history and r.lookup for r in recs) and any(r.history and r.accept_len > 0 for r in recs)
    # without the history: the same tokens, no chain from it
    engine.lookup_history = None
    again = forced_lookup_run(engine, draft, prompts, HistoryFirstGate)
    assert [r.token_ids for r in again] == [r.token_ids for r in ar]
    assert not any(r.history for x in again for r in x.stats.records)


def test_gate_asks_less_often_where_its_choices_keep_declining():
    """After DECLINED_RUN declined choices at a batch-size bucket the engine asks every 2nd round,
    half as often after every further DECLINED_RUN declines, down to every SKIP_MAX-th; a taken
    choice resets the bucket; other buckets are asked every round meanwhile."""
    gate = LookupGate()
    asked = []
    for _ in range(8 * gate.DECLINED_RUN * gate.SKIP_MAX // 2):
        due = gate.due(8)
        asked.append(due)
        if due:
            gate.answered(8, False)
    first = asked[:gate.DECLINED_RUN]
    assert all(first)
    gaps = [i for i, a in enumerate(asked) if a]
    steps = [b - a for a, b in zip(gaps, gaps[1:])]
    assert steps[:gate.DECLINED_RUN - 1] == [1] * (gate.DECLINED_RUN - 1)
    assert 2 in steps and steps[-1] == gate.SKIP_MAX and max(steps) == gate.SKIP_MAX
    # every interval between: each held for DECLINED_RUN asks
    assert sorted(set(steps)) == [1 << i for i in range(gate.SKIP_MAX.bit_length())]
    assert all(steps.count(1 << i) >= gate.DECLINED_RUN for i in range(1, gate.SKIP_MAX.bit_length() - 1))
    assert all(gate.due(1) for _ in range(10))                  # another bucket: asked every round
    gate.answered(8, True)
    assert all(gate.due(8) for _ in range(gate.DECLINED_RUN))   # taken: every round again
    # near misses (a round expected at CLEAR_DECLINE or more of the alternative) keep it asked
    verify = lambda mean, most: 10.0 + (mean - 1.0)             # noqa: E731  (ms: cheap extra nodes)
    proposals = [([5, 6, 7], 3)]
    taken = gate.choose(proposals, verify, 0.0, batch_bucket=8)
    rate = 1e3 * taken.expected_tokens / taken.predicted_ms       # what the best lookup round delivers
    for alt, near in ((rate / 0.9, True), (rate / 0.5, False)):
        assert gate.choose(proposals, verify, alt, batch_bucket=8) is None
        assert gate.near_miss is near, (alt, near)
    for _ in range(3 * gate.DECLINED_RUN):                      # declined, but each a near miss
        assert gate.due(16)
        gate.near_miss = True                                   # (what choose() reports of one)
        gate.answered(16, False)
        assert not gate.near_miss                               # used up by the answer


def test_gate_says_which_proposal_holds_a_static_batch():
    gate = LookupGate(kmax=4)
    assert gate.holds_batch(([], 0), 0, 50)               # among the slowest, no chain
    assert not gate.holds_batch(([], 0), 1, 50)           # ahead: a level-1 round does not need it
    assert not gate.holds_batch(([], 0), 0, 1)            # ends with this round's bonus
    assert not gate.holds_batch(([3, 4], 8), 0, 50)
    # and choose() agrees: with such a request no round is chosen, whatever the others propose
    taught = _taught(LookupGate(kmax=4), match_bucket(8), 0.95)
    props = [([], 0)] + [([1] * 4, 8)] * 3
    assert taught.choose(props, lambda mean, most: 10.0, 0.0, [50] * 4, lead=[0, 0, 1, 1]) is None
    assert taught.choose(props, lambda mean, most: 10.0, 0.0, [50] * 4, lead=[1, 0, 0, 0]) is not None
