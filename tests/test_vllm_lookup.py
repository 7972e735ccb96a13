"""Context lookup in the vLLM plugin (heterospec.vllm_plugin.lookup): no vLLM needed.

A simulated vLLM step loop: each step the proposer sees the rows vLLM sampled (rejected positions
-1) and the requests' tokens through the previous step, as ``prepare_next_token_ids_padded`` and
``CachedRequestState`` give them; the end-to-end runs in vLLM are in test_vllm_plugin.py."""

import pytest

from heterospec.lookup import MATCH_BUCKETS, match_bucket
from heterospec.vllm_plugin.costs import StepCosts
from heterospec.vllm_plugin.lookup import LookupSteps

V = 50


def _costs(verify_slope: float, plain: float = 60.0, spec_level: float = 61.0) -> StepCosts:
    costs = StepCosts()
    for b in (1, 4):
        for _ in range(3):
            for x in (0, 1, 6):
                costs.add_target(b, b * (1 + x), plain if x == 0 else spec_level + verify_slope * x)
    return costs


class _Request:
    def __init__(self, prompt):
        self.prompt_token_ids, self.output_token_ids = list(prompt), []


def _truth(rid: int, n: int):
    """The target's greedy text of request ``rid``: a loop of period 5 + rid after a short preamble."""
    period = [(7 * rid + 3 * j) % V for j in range(5 + rid)]
    return [40 + rid, 41] + [period[j % len(period)] for j in range(n)]


def _simulate(steps: int, B: int, costs: StepCosts, max_tokens=10 ** 6):
    """Requests 0..B-1 with prompts [1, 2, 3 + rid]; every step the lookup step's chains (if the
    gate chose one) are verified against each request's true text. Returns (LookupSteps, requests,
    accepted draft tokens)."""
    ls = LookupSteps(kmax=6)
    ids = [f"r{i}" for i in range(B)]
    reqs = {rid: _Request([1, 2, 3 + i]) for i, rid in enumerate(ids)}
    truth = {rid: _truth(i, 400) for i, rid in enumerate(ids)}
    sampled = [[truth[rid][0]] for rid in ids]           # the prefill step's sampled token
    accepted_total = 0
    for _ in range(steps):
        ls.feed(ids, sampled, [False] * B, lambda rid: (reqs[rid].prompt_token_ids, reqs[rid].output_token_ids), V)
        # the runner's bookkeeping, after the proposer
        for rid, row in zip(ids, sampled):
            reqs[rid].output_token_ids.extend(t for t in row if t >= 0)
        for rid in ids:
            assert ls.tokens(rid) == reqs[rid].prompt_token_ids + reqs[rid].output_token_ids
        room = [max_tokens - len(reqs[rid].output_token_ids) for rid in ids]
        chosen = ls.choose(ids, 6, room, costs, B, 0.0, lambda: 1e3 * B / costs.plain_level(B))
        # next step: what the target samples for the proposed chains
        new_sampled = []
        for i, rid in enumerate(ids):
            chain = chosen.chains[i] if chosen is not None else []
            out = len(reqs[rid].output_token_ids)
            a = 0
            while a < len(chain) and chain[a] == truth[rid][out + a]:
                a += 1
            accepted_total += a
            new_sampled.append(truth[rid][out:out + a + 1] + [-1] * (len(chain) - a))
        if chosen is not None:
            ls.ran(ids, chosen)
        else:
            ls.forget_step()
        # vLLM's rejected counts, seen at the next step
        rejected = None if chosen is None else \
            [len(c) - (len([t for t in row if t >= 0]) - 1) for c, row in zip(chosen.chains, new_sampled)]
        sampled = new_sampled
        ls.observe(ids, rejected, 0.07 if chosen is not None else None)
    return ls, reqs, accepted_total


def test_context_follows_vllms_committed_tokens_and_loops_are_copied():
    ls, reqs, accepted = _simulate(60, 4, _costs(verify_slope=0.5))
    assert ls.steps > 10 and accepted > 100           # the loops were copied, and accepted
    assert ls.rebuilt == 4                            # one index per request, grown step by step
    # a loop's match is long: its bucket learned that copied tokens are accepted
    assert ls.gate.accept(match_bucket(8))[0] > 0.9


def test_no_lookup_step_where_verifying_costs_more_than_it_makes():
    ls, _, accepted = _simulate(30, 4, _costs(verify_slope=200.0, spec_level=200.0))
    assert ls.steps == 0 and accepted == 0


def test_chains_leave_room_for_the_bonus_token():
    ls = LookupSteps(kmax=6)
    loop = [5, 6, 7] * 6
    ls.feed(["a"], [[5]], [False], lambda rid: (loop, []), V)
    chosen = ls.choose(["a"], 6, [3], _costs(0.5), 1, 0.0, 1.0)
    assert chosen is not None and chosen.chains == [[6, 7]]
    assert ls.choose(["a"], 6, [1], _costs(0.5), 1, 0.0, 1.0) is None      # one token left: the bonus
    assert ls.choose(["a"], 0, [9], _costs(0.5), 1, 0.0, 1.0) is None      # no draft slots this step


def test_partial_prefills_and_unknown_steps_propose_nothing_and_stale_indices_are_rebuilt():
    ls = LookupSteps(kmax=4)
    hist = {"a": ([1, 2, 3, 1, 2], []), "b": ([9, 9, 9], [])}
    ls.feed(["a", "b"], [[3], [7]], [False, True], hist.get, V)
    assert ls.tokens("a") == [1, 2, 3, 1, 2, 3] and ls.tokens("b") is None
    assert ls.proposals(["a", "b"], 4)[1] == ([], 0)
    assert ls.proposals(["a"], 3)[0] == ([1, 2, 3], 3)
    # a request whose tokens moved on without the proposer (preempted, a step not seen): rebuilt
    hist["a"] = ([1, 2, 3, 1, 2], [3, 4, 4])
    ls.feed(["a"], [[4, -1, 99999]], [False], hist.get, V)
    assert ls.tokens("a") == [1, 2, 3, 1, 2, 3, 4, 4, 4] and ls.rebuilt == 2
    ls.feed(["a"], None, None, hist.get, V)          # the step's tokens unknown: indices dropped
    assert len(ls) == 0
    # finished requests leave: only the batch's requests keep an index
    ls.feed(["a"], [[1]], [False], lambda rid: ([1, 2], []), V)
    ls.feed(["c"], [[1]], [False], lambda rid: ([3], []), V)
    assert ls.tokens("a") is None and ls.tokens("c") == [3, 1]
    # no token ids (prompt embeddings): no index
    ls.feed(["d"], [[1]], [False], lambda rid: None, V)
    assert ls.tokens("d") is None


def test_observe_learns_each_chains_accepted_length_and_ignores_requests_that_left():
    ls = LookupSteps(kmax=4)
    loop = [5, 6, 7] * 4
    ls.feed(["a", "b"], [[5], [5]], [False, False], lambda rid: (loop, []), V)
    chosen = ls.choose(["a", "b"], 4, [50, 50], _costs(0.1), 4, 0.0, 1.0)
    assert chosen is not None and all(len(c) == 4 for c in chosen.chains)
    bucket = chosen.buckets[0]
    before = list(ls.gate._tried[bucket])
    ls.ran(["a", "b"], chosen)
    assert ls.pending and ls.pending_lengths() == [4, 4]
    # next step: "a" accepted 2 of 4 (2 rejected), "b" finished (not in the batch)
    assert ls.observe(["a"], [2], 0.05)
    assert not ls.pending and not ls.observe(["a"], [0], 0.05)
    tried = ls.gate._tried[bucket]
    assert tried[0] == pytest.approx(before[0] + 1) and tried[2] == pytest.approx(before[2] + 1)
    assert tried[3] == pytest.approx(before[3])      # never judged: its predecessor was rejected
    assert ls.gate._hit[bucket][2] == pytest.approx(0.0)
    assert ls.gate.time_scale(chosen.batch_bucket) != 1.0        # the step's time was learned


def test_requests_that_leave_join_the_history_and_later_requests_copy_from_it():
    ls = LookupSteps(kmax=4)
    answer = [20, 21, 22, 23, 24, 25]
    ls.feed(["a"], [[answer[0]]], [False], lambda rid: ([1, 2, 3], []), V)
    ls.feed(["a"], [answer[1:]], [False], lambda rid: ([1, 2, 3], [answer[0]]), V)
    assert len(ls.history) == 0
    # "a" finished; "b" (another prompt ending as "a"'s did) starts: "a"'s answer is its proposal
    ls.feed(["b"], [[20]], [False], lambda rid: ([9, 2, 3], []), V)
    assert ls.history.tokens == [1, 2, 3] + answer
    chain = ls.proposals(["b"], 4)[0]
    assert chain[0] == [21, 22, 23, 24] and chain[2] is True
    # the history's chains are priced and recorded under its rows
    chosen = ls.choose(["b"], 4, [50], _costs(0.1), 1, 0.0, 1.0)
    assert chosen is not None and chosen.buckets[0] >= len(MATCH_BUCKETS)
    # a request with "a"'s own prompt does not copy "a"'s answer
    ls.feed(["c"], [[20]], [False], lambda rid: ([1, 2, 3], []), V)
    assert ls.proposals(["c"], 4)[0] == ([], 0)
    assert LookupSteps(kmax=4, history=False).history is None


def test_the_lookup_corpus_competes_where_the_own_context_matches_little():
    from heterospec.datastore import SEP, CorpusIndex
    from heterospec.lookup import CORPUS_ROW, CORPUS_SOURCE

    corpus = CorpusIndex(([4, 5, 6, 30, 31, 32, SEP]) * 6)
    ls = LookupSteps(kmax=4, history=False, corpus=corpus)
    ls.feed(["a"], [[6]], [False], lambda rid: ([1, 4, 5], []), V)
    chain = ls.proposals(["a"], 4)[0]
    assert chain == ([30, 31, 32], 5, CORPUS_SOURCE)
    chosen = ls.choose(["a"], 4, [50], _costs(0.1), 1, 0.0, 1.0)
    assert chosen is not None and chosen.buckets[0] == CORPUS_ROW + 4
    # a request whose own context matches 3 tokens or more does not ask the corpus
    ls.feed(["b"], [[6]], [False], lambda rid: ([4, 5, 6, 9, 4, 5], []), V)
    assert ls.proposals(["b"], 4)[0] == ([9, 4, 5, 6], 3)
    assert LookupSteps(kmax=4).corpus is None
