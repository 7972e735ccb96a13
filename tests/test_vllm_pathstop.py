"""The vLLM plugin's path stop (heterospec.vllm_plugin.pathstop): no vLLM needed."""

import pytest
import torch

from heterospec.vllm_plugin.pathstop import ConfidenceCalibration, LookaheadCalibration, PathStop


def test_calibration_starts_at_the_draft_confidence_and_learns_the_targets_verdicts():
    cal = ConfidenceCalibration()
    c = torch.tensor([0.05, 0.5, 0.95])
    assert torch.allclose(cal(c), c.double())
    # an over-confident draft: tokens at 0.9-1.0 accepted half the time
    for i in range(400):
        cal.observe([[0.95]], [i % 2])
    assert abs(float(cal(torch.tensor([0.95]))) - 0.5) < 0.05
    assert abs(float(cal(torch.tensor([0.35]))) - 0.35) < 1e-6          # other buckets untouched


def test_calibration_judges_the_accepted_tokens_and_the_first_rejected_one_only():
    cal = ConfidenceCalibration()
    cal.observe([[0.15, 0.45, 0.75]], [1])           # token 1 accepted, 2 rejected, 3 never judged
    assert cal.drafted[1] == 1 and cal.accepted[1] == 1
    assert cal.drafted[4] == 1 and cal.accepted[4] == 0
    assert cal.drafted[7] == 0
    cal.observe([[0.15, 0.45]], [2])                 # both accepted, nothing rejected
    assert cal.drafted[4] == pytest.approx(1 * cal.KEEP + 1) and cal.accepted[4] == 1


def _run(stop: PathStop, bins, confs):
    """Drive ``stop`` as the proposer does: one confidence row per forward, until it stops."""
    stop.begin(bins)
    for row in confs:
        if not stop.step(torch.tensor(row)):
            break
    return stop.lengths, stop.forwards


def _brute_force(p, plain_ms, verify_ms, draft_ms, limit):
    """Chain length with the most tokens per ms when every draft is accepted with probability p
    given its predecessors: a step with j drafts makes 1 + p + ... + p^j tokens in
    plain_ms + j * verify_ms + (j - 1) * draft_ms."""
    best = max(range(1, limit + 1), key=lambda j: (1 + sum(p ** i for i in range(1, j + 1))) /
               (plain_ms + j * verify_ms + (j - 1) * draft_ms))
    rate = (1 + sum(p ** i for i in range(1, best + 1))) / (plain_ms + best * verify_ms + (best - 1) * draft_ms)
    return best, rate


@pytest.mark.parametrize("p,verify_ms,draft_ms", [(0.9, 3.0, 4.0), (0.8, 6.0, 5.0), (0.6, 2.0, 3.0),
                                                  (0.95, 1.0, 1.0), (0.5, 10.0, 10.0)])
def test_batch_one_chain_is_the_throughput_optimum(p, verify_ms, draft_ms):
    limit = 8
    best, rate = _brute_force(p, 60.0, verify_ms, draft_ms, limit)
    stop = PathStop(ConfidenceCalibration(), rate, verify_ms, draft_ms, batch_size=1, limit=limit)
    lengths, forwards = _run(stop, [limit], [[p]] * limit)
    assert lengths == [best] and forwards == best


def test_requests_keep_their_own_lengths_and_a_bin_of_length_zero_drafts_nothing():
    stop = PathStop(ConfidenceCalibration(), rate=0.05, verify_ms=4.0, draft_ms=2.0, batch_size=3, limit=6)
    # request 0 confident throughout, request 1 unsure from its second token, request 2's bin: no drafts
    lengths, forwards = _run(stop, [3, 1, 0], [[0.95, 0.9, 0.9]] + [[0.95, 0.05, 0.9]] * 5)
    assert lengths[2] == 0
    assert lengths[1] == 1                         # its first token: its bin drafts; the second does not pay
    assert lengths[0] > 3 and forwards == lengths[0]      # extended beyond its bin's 3 while it pays


def test_expensive_draft_forwards_stop_after_the_first():
    stop = PathStop(ConfidenceCalibration(), rate=0.05, verify_ms=1.0, draft_ms=200.0, batch_size=1, limit=6)
    assert _run(stop, [2], [[0.99]] * 6) == ([1], 1)


def _brute_force_costs(p, plain_ms, step_ms, draft_ms, limit):
    """As _brute_force, with a measured step cost per chain length (``step_ms[j]``: j drafts)."""
    def rate(j):
        return (1 + sum(p ** i for i in range(1, j + 1))) / (step_ms[j] + (j - 1) * draft_ms)
    best = max(range(1, limit + 1), key=rate)
    return best, rate(best)


@pytest.mark.parametrize("p", [0.3, 0.5, 0.8])
def test_a_longer_chain_measured_cheaper_is_drafted_and_the_chain_is_the_optimum(p):
    """Batch 1 on the Zen 4 box: a step verifying one draft token cost more than one verifying
    2-5. With per-position marginal costs the second token is drafted even where it adds little,
    and the chain is still the throughput optimum (brute force over the measured costs)."""
    limit = 6
    step_ms = [40.0, 46.0, 40.0, 40.5, 41.0, 41.5, 42.0]         # j drafts (j = 0: plain)
    draft_ms = 2.5
    best, rate = _brute_force_costs(p, 40.0, step_ms, draft_ms, limit)
    marginal = [0.5] + [step_ms[j] - step_ms[j - 1] for j in range(2, limit + 1)]
    stop = PathStop(ConfidenceCalibration(), rate, marginal, draft_ms, batch_size=1, limit=limit)
    lengths, _ = _run(stop, [limit], [[p]] * limit)
    assert lengths == [best] and best >= 2


def test_path_stop_rejects_bad_settings():
    with pytest.raises(ValueError, match="rate"):
        PathStop(ConfidenceCalibration(), rate=0.0, verify_ms=1.0, draft_ms=1.0, batch_size=1, limit=2)
    with pytest.raises(ValueError, match="limit"):
        PathStop(ConfidenceCalibration(), rate=1.0, verify_ms=1.0, draft_ms=1.0, batch_size=1, limit=0)
    with pytest.raises(ValueError, match="one per position"):
        PathStop(ConfidenceCalibration(), rate=1.0, verify_ms=[1.0], draft_ms=1.0, batch_size=1, limit=3)
    with pytest.raises(ValueError, match="one per position"):
        PathStop(ConfidenceCalibration(), rate=1.0, verify_ms=[1.0, float("nan")], draft_ms=1.0, batch_size=1, limit=2)


def test_non_finite_confidences_are_not_trusted():
    cal = ConfidenceCalibration()
    assert float(cal(torch.tensor([float("nan")]))) == 0.0
    cal.observe([[float("inf"), float("nan")]], [0])          # counted in the lowest bucket, no crash
    assert cal.drafted[0] == 1


def test_lookahead_judges_each_accepted_token_by_the_token_after_it():
    la = LookaheadCalibration(ConfidenceCalibration())
    c = torch.tensor([0.05, 0.5, 0.95])
    assert torch.allclose(la(c), c.double())             # no evidence: the base calibration, a(c) = c
    la.observe([[0.15, 0.45, 0.75]], [1])                # token 1 accepted, token 2 (after it) rejected
    assert la.drafted[1] == 1 and la.accepted[1] == 0 and la.drafted[4] == 0
    la.observe([[0.15, 0.45, 0.75]], [3])                # all accepted: tokens 1, 2 judged (3 has no successor)
    assert la.accepted[1] == 1 and la.drafted[4] == 1 and la.accepted[4] == 1 and la.drafted[7] == 0
    la.observe([[0.65]], [1])                            # a chain of one token: nothing after it to judge
    assert la.drafted[6] == 0


def test_a_chain_goes_on_only_if_the_token_after_a_confident_one_tends_to_be_accepted():
    """The draft's token 1 is accepted whenever it is confident, but the token after it only a
    quarter of the time: with a(c) as the forecast the chain would go on; with the lookahead
    learned from the target's verdicts it stops after one forward."""
    cal = ConfidenceCalibration()
    la = LookaheadCalibration(cal)
    for i in range(400):
        chain, acc = [[0.95, 0.5]], [2 if i % 4 == 0 else 1]
        cal.observe(chain, acc)
        la.observe(chain, acc)
    assert float(cal(torch.tensor([0.95]))) > 0.95
    assert float(la(torch.tensor([0.95]))) == pytest.approx(0.25, abs=0.05)
    # another forward pays iff S_1 * n(c_1) >= rate * (draft_ms + verify_ms) = 0.02 * 15 = 0.3
    naive = PathStop(cal, rate=0.02, verify_ms=5.0, draft_ms=10.0, batch_size=1, limit=4)
    assert _run(naive, [4], [[0.95]] * 4)[1] > 1
    ahead = PathStop(cal, rate=0.02, verify_ms=5.0, draft_ms=10.0, batch_size=1, limit=4, lookahead=la)
    assert _run(ahead, [4], [[0.95]] * 4) == ([1], 1)


def _reference_run(cal, la, rate, verify_ms, draft_ms, batch_size, limit, bins, confs):
    """The path stop's rule over whole tensors (its first, vectorized form): lengths, forwards."""
    keep_at = [rate * v / batch_size for v in verify_ms] + [float("inf")]
    survival = torch.ones(len(bins), dtype=torch.float64)
    alive = torch.tensor([k > 0 for k in bins])
    lengths, forwards = [0] * len(bins), 0
    for j, row in enumerate(confs, start=1):
        forwards = j
        conf = torch.tensor(row, dtype=torch.float64)
        s = survival * cal(conf)
        keep = alive & ((s >= keep_at[j - 1]) | (j == 1))
        for r in torch.nonzero(keep).flatten().tolist():
            lengths[r] = j
        survival = torch.where(keep, s, torch.zeros_like(s))
        nxt = survival * la(conf)
        alive = keep & (nxt >= keep_at[j])
        if j >= limit or not bool(alive.any()):
            break
        n_alive = int(alive.sum())
        if float(nxt[alive].sum()) < rate * (draft_ms + verify_ms[j] * n_alive / batch_size):
            break
    return lengths, forwards


def test_path_stop_decides_as_its_vectorized_rule_on_random_batches():
    """The path stop runs on Python floats (a few confidences per forward); random batches,
    bins, costs and learned calibrations: the same lengths and forwards as the rule over tensors."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        cal = ConfidenceCalibration()
        la = LookaheadCalibration(cal)
        for _ in range(int(torch.randint(0, 60, (1,), generator=g))):
            chain = torch.rand(int(torch.randint(1, 5, (1,), generator=g)), generator=g).tolist()
            acc = int(torch.randint(0, len(chain) + 1, (1,), generator=g))
            cal.observe([chain], [acc])
            la.observe([chain], [acc])
        B, limit = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        verify = (torch.rand(limit, generator=g) * 6 - 1).tolist()       # marginal costs, some negative
        rate, draft_ms = 0.01 + 0.2 * float(torch.rand(1, generator=g)), 3 * float(torch.rand(1, generator=g))
        bins = torch.randint(0, 3, (B,), generator=g).tolist()
        confs = torch.rand(limit, B, generator=g).tolist()
        if trial % 10 == 0:
            confs[0][0] = float("nan")
        stop = PathStop(cal, rate, verify, draft_ms, batch_size=B, limit=limit, lookahead=la)
        assert _run(stop, bins, confs) == _reference_run(cal, la, rate, verify, draft_ms, B, limit, bins, confs), trial
