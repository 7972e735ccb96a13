"""Where each request's draft chain stops: HeteroSpec's cumulative path measure, read at every step.

vLLM's EAGLE-3 proposer drafts a chain per request. The entropy bin read after the first draft
forward says *whether* a request drafts (the bin's action; :mod:`.proposer`); how far it is worth
drafting depends on how the chain goes on. After each draft forward ``j`` this module reads
every request's draft confidence ``c_j`` (the draft's top-1 probability of the token it just
drafted) and keeps the *path survival*

    S_j = a(c_1) * a(c_2) * ... * a(c_j)      the probability that drafts 1..j are all accepted

where ``a(c)`` is the acceptance probability of a draft token of confidence ``c`` given that
its predecessors were accepted: the draft's own confidence, corrected online by what the target
accepted (:class:`ConfidenceCalibration`; a draft trained on little data is over-confident, and
the correction is per device-independent confidence bucket, learned in a few hundred tokens).

The chain is priced by marginal throughput. A step produces ``tokens / ms`` on average
(``rate``, measured from the engine's own speculative steps). Draft token ``j`` of request ``r``
adds ``S_j`` expected tokens and costs the target's slope ``s / B`` ms to verify (``s`` = ms per
draft token per request, the step-cost model's speculative slope); one more draft forward costs
``g`` ms (the draft line's slope) for the whole batch. So, after forward ``j``:

* request ``r`` keeps token ``j`` iff ``S_j >= rate * s / B`` (token 1: whenever its bin drafts);
* request ``r`` stays *alive* iff it kept token ``j`` and its next token would still be worth
  verifying: ``S_j * n(c_j) >= rate * s / B``. The next confidence is not known before the next
  forward: ``n(c)`` is the probability that the token *after* one of confidence ``c`` is
  accepted (that one accepted), learned online as ``a`` is (:class:`LookaheadCalibration`,
  starting at ``a(c)``). Taking ``a(c_j)`` itself for it was optimistic: a chain goes on exactly
  when its last token was confident, and the token after it is accepted far less often
  (bench/RESULTS.md, twenty-fifth session);
* the loop runs another forward iff ``sum_alive S_j * n(c_j) >= rate * (g + s * n_alive / B)``:
  the expected tokens of one more forward, per ms, beat what a step makes per ms on average.

``s`` may differ per position: a step's measured cost need not rise with its draft tokens (at
batch 1 on the Zen 4 box a step verifying one draft token cost 5-7 ms *more* than one verifying
2-5: bench/RESULTS.md, thirty-seventh session), so the step-cost model gives each position ``j``
its own marginal cost ``s_j = T(j) - T(j - 1)`` where the steps of those draft counts were
measured often enough (:meth:`.StepCosts.marginal_verify_ms`), the line's slope elsewhere. A
negative ``s_j`` makes token ``j`` worth drafting whatever it adds.

Gains fall along a chain (``S`` only shrinks), so stopping at the first step that does not pay
is the greedy optimum of tokens per ms (with one slope ``s``). No vLLM import here: the rule is
tested on its own.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch


class ConfidenceCalibration:
    """``a(c)``: the probability that a draft token of top-1 confidence ``c`` is accepted (its
    predecessors accepted), per confidence bucket, starting from ``a(c) = c``.

    Each bucket keeps exponentially forgotten counts of accepted and drafted tokens; the
    estimate shrinks towards ``c`` itself with ``PRIOR`` pseudo-tokens, so an empty bucket trusts
    the draft and a full one trusts the target's verdicts. The counts are Python floats: the
    path stop reads a few confidences per draft forward, where each torch op on a tensor of
    batch size costs more than the arithmetic (bench/RESULTS.md, seventieth session)."""

    BUCKETS = 10
    PRIOR = 4.0
    KEEP = 0.995          # per observed token: ~200 tokens of memory per bucket

    def __init__(self) -> None:
        self.accepted = [0.0] * self.BUCKETS
        self.drafted = [0.0] * self.BUCKETS

    def _bucket_of(self, conf: float) -> int:
        c = float(conf)
        return min(self.BUCKETS - 1, max(0, int(c * self.BUCKETS))) if math.isfinite(c) else 0

    def _priors(self, cs: List[float]) -> List[float]:
        """What an empty bucket predicts, per (finite, clamped) confidence: the draft's own."""
        return cs

    def values(self, confidences: Sequence[float]) -> List[float]:
        """``a(c)`` of each confidence (a non-finite one: no trust)."""
        cs = [min(1.0, max(0.0, c)) if math.isfinite(c) else 0.0 for c in confidences]
        out = []
        for c, prior in zip(cs, self._priors(cs)):
            b = min(self.BUCKETS - 1, int(c * self.BUCKETS))
            out.append(min(1.0, max(0.0, (self.accepted[b] + self.PRIOR * prior) / (self.drafted[b] + self.PRIOR))))
        return out

    def __call__(self, conf: torch.Tensor) -> torch.Tensor:
        """``a(c)`` for a tensor of confidences (float64, same shape)."""
        flat = conf.detach().double().cpu().flatten().tolist()
        return torch.tensor(self.values(flat), dtype=torch.float64).reshape(conf.shape)

    def _count(self, conf: float, hit: bool) -> None:
        """One verdict in the bucket of ``conf``, the bucket's older counts forgotten by ``KEEP``."""
        b = self._bucket_of(conf)
        self.accepted[b] = self.accepted[b] * self.KEEP + (1.0 if hit else 0.0)
        self.drafted[b] = self.drafted[b] * self.KEEP + 1.0

    def observe(self, confidences: Sequence[Sequence[float]], accepted: Sequence[int]) -> None:
        """Request ``r`` drafted tokens of confidences ``confidences[r]`` and the target accepted
        the first ``accepted[r]``: those count as accepted, the next one (if any) as rejected, the
        rest were never judged."""
        for conf, acc in zip(confidences, accepted):
            for j in range(min(len(conf), int(acc) + 1)):
                self._count(conf[j], j < acc)


class LookaheadCalibration(ConfidenceCalibration):
    """``n(c)``: the probability that the draft token *after* one of confidence ``c`` is accepted,
    given that one was: per bucket of ``c``, shrunk towards ``base(c)`` (the acceptance of the
    token of confidence ``c`` itself, :class:`ConfidenceCalibration`) with ``PRIOR`` pseudo-tokens."""

    def __init__(self, base: ConfidenceCalibration) -> None:
        super().__init__()
        self.base = base

    def _priors(self, cs: List[float]) -> List[float]:
        return self.base.values(cs)

    def observe(self, confidences: Sequence[Sequence[float]], accepted: Sequence[int]) -> None:
        """As :meth:`ConfidenceCalibration.observe`, each token judged by what became of the
        token after it: request ``r``'s token ``j`` (accepted, with a successor drafted) counts
        as accepted when that successor was."""
        for conf, acc in zip(confidences, accepted):
            for j in range(min(len(conf) - 1, int(acc))):
                self._count(conf[j], j + 1 < acc)


class PathStop:
    """The chain of one ``propose`` call, decided step by step (see the module docstring).

    Use: :meth:`begin` with each request's bin length (0: the request does not draft), then
    :meth:`step` after every draft forward with the confidences of the tokens it drafted; it
    returns whether the loop should run another forward. :attr:`lengths` are the tokens each
    request keeps."""

    def __init__(self, calibration: ConfidenceCalibration, rate: float, verify_ms, draft_ms: float,
                 batch_size: int, limit: int, lookahead: Optional[ConfidenceCalibration] = None) -> None:
        # verify_ms: ms per draft token per request, one number or one per position 1..limit
        per = [float(verify_ms)] * max(int(limit), 1) if isinstance(verify_ms, (int, float)) \
            else [float(v) for v in verify_ms]
        if rate <= 0 or draft_ms < 0 or batch_size < 1 or limit < 1 or len(per) < limit \
                or not all(math.isfinite(v) for v in per) or (isinstance(verify_ms, (int, float)) and verify_ms < 0):
            raise ValueError(f"PathStop: rate {rate} must be > 0, draft_ms {draft_ms} >= 0, verify_ms {verify_ms} "
                             f">= 0 (or finite, one per position 1..limit), batch_size {batch_size} and limit {limit} >= 1")
        self.calibration = calibration
        self.lookahead = lookahead if lookahead is not None else calibration     # n(c); a(c) without one
        self.rate, self.draft_ms = float(rate), float(draft_ms)
        self.verify_ms = per[:int(limit)]
        self.batch_size, self.limit = int(batch_size), int(limit)
        # per position j = 1..limit (index j - 1): the expected tokens a kept token j must add
        self.keep_at = [self.rate * v / self.batch_size for v in self.verify_ms] + [math.inf]
        self.survival: Optional[List[float]] = None     # per request: S_j (0 once it stopped)
        self.alive: List[bool] = []
        self.lengths: List[int] = []
        self.confidences: List[List[float]] = []
        self.forwards = 0

    def begin(self, bin_lengths: Sequence[int]) -> None:
        n = len(bin_lengths)
        self.survival = [1.0] * n
        self.alive = [int(k) > 0 for k in bin_lengths]
        self.lengths = [0] * n
        self.confidences = [[] for _ in range(n)]
        self.forwards = 0

    def step(self, confidence: torch.Tensor) -> bool:
        """Forward ``j = forwards + 1`` drafted one token per request, of top-1 probabilities
        ``confidence`` (``[B]``). Returns True when another forward pays."""
        assert self.survival is not None, "PathStop.begin first"
        self.forwards += 1
        j = self.forwards
        conf = confidence.detach().cpu().tolist()
        a, ahead = self.calibration.values(conf), self.lookahead.values(conf)
        keep_at, keep_next = self.keep_at[j - 1], self.keep_at[j]
        gain, n_alive = 0.0, 0
        for r, alive in enumerate(self.alive):
            s = self.survival[r] * a[r]
            if alive and (s >= keep_at or j == 1):
                self.lengths[r] = j
                self.confidences[r].append(float(conf[r]))
                self.survival[r] = s
                nxt = s * ahead[r]              # the next token's expected gain
                if nxt >= keep_next:
                    gain += nxt
                    n_alive += 1
                    continue
            else:
                self.survival[r] = 0.0
            self.alive[r] = False
        if j >= self.limit or n_alive == 0:
            return False
        return gain >= self.rate * (self.draft_ms + self.verify_ms[j] * n_alive / self.batch_size)
