"""EOS and max_new_tokens inside an accepted path: the engine cuts a round's accepted drafts at the
stop and never emits past it, for one request, sampled decoding and a batch whose requests stop
in different rounds.

Every case asserts where the stop fell (``stop_position``: an accepted draft, not the bonus), so
none depends on a seed's luck; the oracle draft proposes the target's own greedy path, so rounds
accept whole paths.
"""

import pytest

from heterospec.policy import Plan
from tests.engine_util import stop_position, stops_inside_accepted_path
from tests.test_engine import _gen, _pair, _prompts

N_LONG = 16


@pytest.fixture(scope="module")
def oracle():
    engine, draft = _pair("oracle", seed=3)
    engine.target.config.eos_token_ids = ()
    return engine, draft


def _reference(engine, draft, prompt, n=N_LONG):
    return _gen(engine, draft, prompt, max_new_tokens=n, method="autoregressive").token_ids


def _with_eos(engine, eos):
    old = engine.target.config.eos_token_ids
    engine.target.config.eos_token_ids = list(eos)
    return old


def _first_draft_index(long, accepted):
    """An index 1..accepted of ``long`` whose token does not occur earlier: as the EOS, decoding
    stops there, inside round 1's accepted drafts."""
    return next(i for i in range(1, accepted + 1) if long[i] not in long[:i])


@pytest.mark.parametrize("method", ["eagle3", "heterospec"])
def test_greedy_length_and_eos_inside_accepted_path(oracle, method):
    engine, draft = oracle
    prompt = _prompts(engine.target.config.vocab_size, 1, seed=3)[0]
    long = _reference(engine, draft, prompt)
    full = _gen(engine, draft, prompt, max_new_tokens=N_LONG, method=method)
    a1 = full.stats.records[0].accept_len
    assert full.token_ids == long and a1 >= 3, "the oracle's first path must be accepted"
    # max_new_tokens = 2 .. 1 + a1: the last kept token is round 1's (n - 1)-th accepted draft
    for n in range(2, a1 + 2):
        out = _gen(engine, draft, prompt, max_new_tokens=n, method=method)
        assert out.token_ids == long[:n] and out.finish_reason == "length"
        assert stop_position(out) == (0, n - 1, a1), n
    # n = a1 + 2 ends on round 1's bonus: not inside the path (the helper tells them apart)
    out = _gen(engine, draft, prompt, max_new_tokens=a1 + 2, method=method)
    assert stop_position(out) == (0, a1 + 1, a1) and not stops_inside_accepted_path(out)
    # EOS = a token of round 1's accepted drafts
    i = _first_draft_index(long, a1)
    old = _with_eos(engine, [long[i]])
    try:
        out = _gen(engine, draft, prompt, max_new_tokens=N_LONG, method=method)
    finally:
        engine.target.config.eos_token_ids = old
    assert out.token_ids == long[:i + 1] and out.finish_reason == "eos"
    assert stop_position(out) == (0, i, a1)


@pytest.mark.parametrize("method", ["eagle3", "heterospec"])
def test_sampled_eos_inside_accepted_path(oracle, method):
    """temperature > 0 with EOS enabled. top_k = 1 makes the processed distribution one-hot, so
    rejection sampling accepts the oracle's path with certainty and the output is the greedy one;
    the law of sampled continuations with EOS is tested in test_sampling_lossless.py."""
    engine, draft = oracle
    prompt = _prompts(engine.target.config.vocab_size, 1, seed=3)[0]
    long = _reference(engine, draft, prompt)
    kw = dict(max_new_tokens=N_LONG, method=method, temperature=0.8, top_k=1, seed=5)
    a1 = _gen(engine, draft, prompt, **kw).stats.records[0].accept_len
    assert a1 >= 3
    i = _first_draft_index(long, a1)
    old = _with_eos(engine, [long[i]])
    try:
        out = _gen(engine, draft, prompt, **kw)
    finally:
        engine.target.config.eos_token_ids = old
    assert out.token_ids == long[:i + 1] and out.finish_reason == "eos"
    assert stop_position(out) == (0, i, a1)


def test_batch_requests_stop_in_different_rounds(oracle):
    """Request 0 stops at EOS in round 1, request 1 at EOS in round 2, request 2 runs to
    max_new_tokens; each stop is inside an accepted path, and the finished requests change
    nothing for the others (each equals its single-request and autoregressive output)."""
    engine, draft = oracle
    prompts = _prompts(engine.target.config.vocab_size, 3, seed=101)    # seed chosen for the layout below
    n = 14
    longs = [_reference(engine, draft, p, n) for p in prompts]
    eos = {longs[0][2], longs[1][7]}
    firsts = [next((i for i, t in enumerate(seq) if t in eos), None) for seq in longs]
    assert firsts == [2, 7, None], "precondition: the EOS tokens first occur at 2 and 7, not in request 2"
    old = _with_eos(engine, eos)
    try:
        draft.set_prompts(prompts)
        batch = engine.generate_batch(prompts, max_new_tokens=n, method="heterospec")
        singles = [_gen(engine, draft, p, max_new_tokens=n, method="heterospec") for p in prompts]
    finally:
        engine.target.config.eos_token_ids = old
    assert [r.token_ids for r in batch] == [longs[0][:3], longs[1][:8], longs[2]]
    assert [r.finish_reason for r in batch] == ["eos", "eos", "length"]
    assert [r.token_ids for r in singles] == [r.token_ids for r in batch]
    rounds = [stop_position(r)[0] for r in batch]
    assert rounds[0] < rounds[1] < rounds[2], rounds
    assert all(stops_inside_accepted_path(r) for r in batch), [stop_position(r) for r in batch]
    # per-request records: the same rounds as alone (a finished neighbour does not disturb them)
    for b, s in zip(batch, singles):
        assert [(r.accept_len, r.verified) for r in b.stats.records] == \
               [(r.accept_len, r.verified) for r in s.stats.records]


def test_finished_requests_leave_the_batch(oracle, monkeypatch):
    """Once a batch falls to a smaller batch bucket (with tokens enough left to repay the copy),
    the finished requests' rows are dropped from every later forward (the rounds cost what the
    requests still running need), and outputs, finish reasons and streamed tokens still reach
    the caller's request index."""
    import heterospec.engine as engine_module

    monkeypatch.setattr(engine_module, "COMPACT_MIN_LEFT", 1)
    engine, draft = oracle
    prompts = _prompts(engine.target.config.vocab_size, 3, seed=101)    # the layout of the test above
    n = 14
    longs = [_reference(engine, draft, p, n) for p in prompts]
    eos = {longs[0][2], longs[1][7]}
    rows_seen, streamed = [], {0: [], 1: [], 2: []}
    forward = engine.target.forward

    def spy(tokens, *args, **kwargs):
        rows_seen.append(tokens.shape[0])
        return forward(tokens, *args, **kwargs)

    old = _with_eos(engine, eos)
    try:
        draft.set_prompts(prompts)
        monkeypatch.setattr(engine.target, "forward", spy)
        batch = engine.generate_batch(prompts, max_new_tokens=n, method="heterospec",
                                      stream=lambda i, toks: streamed[i].extend(toks))
    finally:
        engine.target.config.eos_token_ids = old
    assert [r.token_ids for r in batch] == [longs[0][:3], longs[1][:8], longs[2]]
    assert [r.finish_reason for r in batch] == ["eos", "eos", "length"]
    assert [streamed[i] for i in range(3)] == [r.token_ids for r in batch]
    # 3 rows until request 0 stops, 2 until request 1 does, then request 2 alone
    assert rows_seen[0] == 3 and rows_seen[-1] == 1, rows_seen
    assert rows_seen == sorted(rows_seen, reverse=True) and 2 in rows_seen, rows_seen
    # With fewer tokens left than COMPACT_MIN_LEFT the copy would not pay: the rows stay.
    monkeypatch.setattr(engine_module, "COMPACT_MIN_LEFT", n)
    rows_seen.clear()
    old = _with_eos(engine, eos)
    try:
        draft.set_prompts(prompts)
        again = engine.generate_batch(prompts, max_new_tokens=n, method="heterospec")
    finally:
        engine.target.config.eos_token_ids = old
    assert [r.token_ids for r in again] == [r.token_ids for r in batch]
    assert set(rows_seen) == {3}, rows_seen


def test_static_batch_credits_how_far_a_round_moved_the_slowest_request():
    """A static batch ends with its slowest request: the engine tells the policy, for every round
    (speculative or plain), how far it moved the least output length of the requests still
    running, not the batch mean (the guard compares that with plain steps). Summed over the
    call that is the slowest request's length."""
    from heterospec.policy import Eagle3Policy

    class Spy(Eagle3Policy):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.progress, self.calls = [], 0

        def round_plan(self, batch_size, context=None, tokens_left=None, catchup=None, timed=True):
            self.calls += 1       # every third round a plain step: both kinds are credited
            plan = self.plan(batch_size, context)
            return plan if self.calls % 3 else Plan("spy", speculate=False, decide_depth=0, entropy_k=4,
                                                     edges=[], depth=[0], budget=[0], binned=False)

        def observe(self, plan, bins, accepted, seconds=None, extend_tokens=None, progress=None, batch_size=None,
                    context=None, one_off_s=0.0):
            self.progress.append(progress)

    engine, draft = _pair("noisy", seed=7)
    engine.target.config.eos_token_ids = ()
    prompts = _prompts(engine.target.config.vocab_size, 4, seed=7)
    draft.set_prompts(prompts)
    spy, n = Spy(engine.config), 24
    batch = engine.generate_batch(prompts, max_new_tokens=n, method="heterospec", policy=spy)
    # Replay the rounds from each request's records: tokens out before the round, and its gain.
    out, rec_i, expected, means = [1] * len(prompts), [0] * len(prompts), [], []
    while any(o < n for o in out):
        active = [b for b in range(len(prompts)) if out[b] < n]
        gains = {}
        for b in active:
            r = batch[b].stats.records[rec_i[b]]
            rec_i[b] += 1
            gains[b] = min(1 if r.plain else r.accept_len + 1, n - out[b])
        least = min(out[b] for b in active)
        behind = [b for b in active if out[b] == least]
        means.append(sum(gains.values()) / len(gains))
        for b in active:
            out[b] += gains[b]
        running = [b for b in active if out[b] < n]
        expected.append(min(out[b] for b in running) - least if running else max(gains[b] for b in behind))
    assert spy.progress == pytest.approx(expected)
    assert sum(spy.progress) == n - 1               # from the prefill's token to the last one
    assert spy.progress != pytest.approx(means), "precondition: the batch mean differs"
    assert [r.token_ids for r in batch] == [_reference(engine, draft, p, n) for p in prompts]


def test_a_round_is_planned_untimed_while_finished_rows_ride_along():
    """The engine tells ``round_plan`` whether the round's time will count (``timed``): False
    exactly for the rounds whose ``observe`` gets no seconds, those of a static batch whose
    finished requests' rows still ride along in the forwards; the fitted policy starts no probe
    burst in them (tests/test_policy.py)."""
    from heterospec.policy import Eagle3Policy

    class Spy(Eagle3Policy):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.timed, self.seconds = [], []

        def round_plan(self, batch_size, context=None, tokens_left=None, catchup=None, timed=True):
            self.timed.append(timed)
            return self.plan(batch_size, context)

        def observe(self, plan, bins, accepted, seconds=None, extend_tokens=None, progress=None, batch_size=None,
                    context=None, one_off_s=0.0):
            self.seconds.append(seconds)

    engine, draft = _pair("noisy", seed=7)
    engine.target.config.eos_token_ids = ()
    prompts = _prompts(engine.target.config.vocab_size, 4, seed=7)
    draft.set_prompts(prompts)
    spy = Spy(engine.config)
    batch = engine.generate_batch(prompts, max_new_tokens=24, method="heterospec", policy=spy)
    assert spy.timed == [s is not None for s in spy.seconds]
    assert True in spy.timed and False in spy.timed, "precondition: requests finish rounds apart"
    assert [r.token_ids for r in batch] == [_reference(engine, draft, p, 24) for p in prompts]


def test_finished_rows_are_dropped_where_the_cost_model_says_the_copy_pays():
    """With a cost model loaded, a batch drops its finished rows once the plain steps the running
    requests save (the model's step of all rows against one of theirs, for the tokens left)
    repay about one step of the whole batch, bucket change or not, and never with fewer than
    COMPACT_MIN_LEFT tokens left or nothing finished; without one, at a smaller batch bucket."""
    from heterospec import costmodel
    from heterospec.engine import COMPACT_MIN_LEFT

    engine, _ = _pair("noisy", seed=7)
    # plain_ms(B) = 10 + B ms: each row costs 1 ms a step, the whole 16-row step 26 ms
    engine._cost_model = costmodel.CostModel(fingerprint={}, tokens=[1, 64], contexts=[256],
                                             target=[[11.0, 74.0]], batch_sizes=[1], plain=[11.0],
                                             draft=[[1.0, 1.0, 0.0]], nodes=[1, 2], verify=[[11.0, 12.0]])
    assert engine._cost_model.plain_ms(16) == pytest.approx(26.0)
    pays = engine._compaction_pays
    assert not pays(16, 15, 25) and pays(16, 15, 26)            # one row: 26 steps repay the copy
    assert pays(16, 13, 9 if COMPACT_MIN_LEFT <= 9 else COMPACT_MIN_LEFT)        # three rows: 9 steps
    assert not pays(16, 8, COMPACT_MIN_LEFT - 1) and pays(16, 8, COMPACT_MIN_LEFT)
    assert not pays(16, 16, 1000) and not pays(1, 1, 1000)
    engine._cost_model = None                                  # no model: the batch bucket decides
    assert not pays(15, 13, 1000) and pays(15, 11, 1000) and not pays(15, 11, COMPACT_MIN_LEFT - 1)


def test_dropping_finished_requests_with_the_eagle3_draft(monkeypatch):
    """The same with a real (random) EAGLE-3 draft: its KV cache and pending extend lose the
    finished rows, and every request still decodes what it decodes alone."""
    import heterospec.engine as engine_module

    monkeypatch.setattr(engine_module, "COMPACT_MIN_LEFT", 1)
    engine, _ = _pair("eagle3-random", seed=11)
    engine.target.config.eos_token_ids = ()
    prompts = _prompts(engine.target.config.vocab_size, 4, seed=11)
    n = 12
    longs = [engine.generate(p, max_new_tokens=n, method="autoregressive").token_ids for p in prompts]
    # the EOS: request 1's 4th token, if it occurs in no other request before their ends
    eos = longs[1][3]
    assert longs[1].index(eos) == 3 and all(eos not in seq for i, seq in enumerate(longs) if i != 1), \
        "precondition: the chosen EOS stops request 1 only"
    engine.target.config.eos_token_ids = [eos]
    rows_seen = []
    forward = engine.draft.extend

    def spy(input_ids, *args, **kwargs):
        rows_seen.append(input_ids.shape[0])
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(engine.draft, "extend", spy)
    for method in ("eagle3", "heterospec"):
        rows_seen.clear()
        out = engine.generate_batch(prompts, max_new_tokens=n, method=method)
        assert [r.token_ids for r in out] == [longs[0], longs[1][:4], longs[2], longs[3]], method
        assert [r.finish_reason for r in out] == ["length", "eos", "length", "length"]
        assert rows_seen[0] == 4 and 3 in rows_seen, (method, rows_seen)


def test_rounds_with_finished_rows_riding_along_are_not_timed(monkeypatch):
    """While finished requests' rows still ride along in a static batch's forwards, the round is
    not timed for the policy (seconds None): it is planned at the requests running, and a
    batch-4 forward timed as a batch-1 round would teach that bucket a wrong time correction."""
    import heterospec.engine as engine_module
    from heterospec.policy import Eagle3Policy

    monkeypatch.setattr(engine_module, "COMPACT_MIN_LEFT", 10 ** 9)      # rows never leave
    seen = []

    class Spy(Eagle3Policy):
        def round_plan(self, batch_size, context=None, tokens_left=None, catchup=None, timed=True):
            seen.append([batch_size])
            return self.plan(batch_size, context)

        def observe(self, plan, bins, accepted, seconds=None, extend_tokens=None, progress=None, batch_size=None,
                    context=None, one_off_s=0.0):
            seen[-1].append(seconds)

    engine, draft = _pair("noisy", seed=7)
    engine.target.config.eos_token_ids = ()
    prompts = _prompts(engine.target.config.vocab_size, 4, seed=7)
    draft.set_prompts(prompts)
    batch = engine.generate_batch(prompts, max_new_tokens=24, method="heterospec", policy=Spy(engine.config))
    assert any(b < 4 for b, _ in seen), "precondition: requests end in different rounds"
    assert all((s is None) == (b < 4) for b, s in seen)
    assert [r.token_ids for r in batch] == [_reference(engine, draft, p, 24) for p in prompts]
