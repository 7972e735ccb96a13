"""What a vLLM engine step costs, learned from the steps themselves.

vLLM runs the target, samples, and then calls the proposer; the time from the end of one
``propose`` call to the start of the next is everything the target side of one step cost
(scheduling, the forward over the step's tokens, rejection sampling, bookkeeping), and the time
inside ``propose`` is the draft's. Per batch-size bucket three quantities are learned:

    plain level           = p_B                      a step without drafts (the target side)
    target_ms(B, T)       = a_B + s_B * (T - B) / B  a step verifying drafts, T = tokens in its forward
    draft_ms(B, steps)    = f_B + g_B * steps        steps = draft forwards after the first
    warm level            = w_B                      the draft's first forward alone, no drafts
                                                     (a plain step that keeps the draft's KV whole)

The speculative line has its own intercept ``a_B`` rather than the plain step's: a step that
verifies drafts also runs the rejection sampler and the drafts' bookkeeping, a fixed cost that a
line through the plain steps would charge to the first draft tokens as a steep slope, and then
extrapolate to longer chains (bench/RESULTS.md, vLLM step costs by K).

The plain step the policy weighs speculation against is a *warm* one, ``plain_ms = p_B + w_B``:
where the plan speculates, its plain steps (probes, the guard's fallback) run the draft's first
forward anyway, so a speculative step is worth taking as soon as it beats that. Only a plan that
loses to the warm step turns the drafter off (``plain_ms`` is then too high by ``w_B``, which
errs towards speculating: going cold is the costly mistake, as every request then keeps a hole
in the draft's KV cache and accepts less for the rest of its life). Each line is fitted to
forgotten means of the steps per x (:class:`_Line`), in *normalized* milliseconds (below), and exposed with the interface
:func:`heterospec.policy.fit_plan` expects of a cost model (``plain_ms``, ``verify_ms``,
``draft_ms``), so the fitted policy is the same one our own engine uses. vLLM packs the requests
of a step without padding, so verification is ragged.

**A machine whose speed drifts.** On a shared CPU the same step's time moves within minutes,
and the kinds of step are measured at different times: the one the plan takes in nearly every
step, plain steps and long chains only now and then. Compared in raw milliseconds, the
differences between the lines were mostly the drift between the moments each was measured
(within one run the 1-token mean crossed the plain level both ways, and the speculative slope
moved several-fold: bench/RESULTS.md, twenty-fifth session). So
every time is kept divided by the machine's current *speed*: the target steps' observed /
expected time, each read against the mean of its own kind once that mean is established,
exponentially averaged (``SPEED_KEEP``). All costs are predicted in those normalized
milliseconds, and whatever the caller compares them with (the policy's guard and corrections,
the path stop's tokens per ms) is normalized by the same speed (:meth:`StepCosts.normalize`),
so a comparison is between kinds of step at one moment's speed.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

from ..policy import FittedPolicy


class _Line:
    """y = level + slope * x, fitted to exponentially forgotten means of y per value of x.

    x is rounded to ``RESOLUTION``; each value keeps the mean of its points (the median of its
    first ``FIRST`` points, so that a first step that paid a one-off cost does not set it; then
    an exponential mean that follows a change of the cost within ~10 points). The line is the least-squares fit
    through those means, each weighted by its points up to ``WEIGHT_CAP``: a value of x seen
    rarely (the long chains of an easy bin) counts as much as one seen in most steps once it was
    measured a few times. An online update of level and slope from each point cannot tell them
    apart when nearly every point has the same x (most steps draft one token): they drifted
    together until the slope was far from the steps' real cost per token."""

    RESOLUTION = 0.25
    FIRST = 5
    KEEP = 0.9
    WEIGHT_CAP = 8.0

    def __init__(self) -> None:
        self.level: Optional[float] = None
        self.slope: Optional[float] = None
        self.n = 0
        self.means: Dict[float, list] = {}      # x -> [mean y, points, first points]
        self.last: Dict[float, int] = {}        # x -> its last point's step (an owner's clock; not saved)

    def key(self, x: float) -> float:
        return round(float(x) / self.RESOLUTION) * self.RESOLUTION

    def measured(self, x: float, points: int) -> Optional[float]:
        """The mean at ``x`` itself (``x`` on the grid) once ``points`` steps were measured there, else None."""
        key = self.key(x)
        m = self.means.get(key) if abs(key - float(x)) < 1e-9 else None
        return m[0] if m is not None and m[1] >= points and m[0] > 0 else None

    def settled(self, x: float) -> Optional[float]:
        """The mean at ``x`` once it has its ``FIRST`` points, else None."""
        m = self.means.get(self.key(x))
        return m[0] if m is not None and len(m[2]) >= self.FIRST and m[0] > 0 else None

    def add(self, x: float, y: float, keep: Optional[float] = None) -> None:
        """A point; ``keep``: the exponential mean's memory after the first points (default ``KEEP``)."""
        self.n += 1
        key = self.key(x)
        m = self.means.setdefault(key, [float(y), 0, []])
        m[1] += 1
        if len(m[2]) < self.FIRST:
            m[2].append(float(y))
            ys = sorted(m[2])
            m[0] = 0.5 * (ys[(len(ys) - 1) // 2] + ys[len(ys) // 2])
        else:
            k = self.KEEP if keep is None else keep
            m[0] = k * m[0] + (1.0 - k) * float(y)
        self._fit()

    def _fit(self) -> None:
        pts = [(x, m[0], min(float(m[1]), self.WEIGHT_CAP)) for x, m in self.means.items()]
        w = sum(p[2] for p in pts)
        mx, my = sum(p[0] * p[2] for p in pts) / w, sum(p[1] * p[2] for p in pts) / w
        sxx = sum(p[2] * (p[0] - mx) ** 2 for p in pts)
        if len(pts) < 2 or sxx <= 1e-12:
            self.level, self.slope = my, None
            return
        self.slope = max(0.0, sum(p[2] * (p[0] - mx) * (p[1] - my) for p in pts) / sxx)
        self.level = my - self.slope * mx

    @property
    def ready(self) -> bool:
        """The slope is identified: two values of x were measured."""
        return self.slope is not None

    @property
    def known(self) -> bool:
        """A level was measured (a line whose x never varied predicts that level)."""
        return self.level is not None

    def at(self, x: float) -> Optional[float]:
        if self.level is None:
            return None
        return max(1e-3, self.level + (self.slope or 0.0) * x)

    def to_list(self) -> list:
        return [[x, m[0], m[1], m[2]] for x, m in sorted(self.means.items())]

    @classmethod
    def from_list(cls, v) -> "_Line":
        line = cls()
        for x, mean, count, first in v:
            line.means[float(x)] = [float(mean), int(count), [float(y) for y in first]]
            line.n += int(count)
        if line.means:
            line._fit()
        return line


class StepCosts:
    """Per batch bucket: plain steps, speculative steps vs. their tokens, the draft vs. its forwards."""

    FORMAT = 2     # format 1: one line through plain and speculative steps, updated per point
    # Memory of the speed estimate, per target step: ~3 steps. A line's means, in normalized ms,
    # remember ~200 *steps* (MEAN_KEEP per target step since the mean's last point, each point
    # weighing at most MEAN_WEIGHT): every kind of step then has the same memory in time however
    # rarely it runs, and a drift is taken up by the speed rather than by the mean of the kind
    # that happened to run while it came (with means as quick as the speed, the 1-token mean
    # took a third of every drift and swung with the machine).
    SPEED_KEEP = 0.7
    MEAN_KEEP = 0.995
    MEAN_WEIGHT = 0.1
    SPEED_STEP = 1.25      # one step moves the speed by at most this factor ** (1 - SPEED_KEEP): an
                           # outlier (a collection, a hiccup of the host) moves it 7 %
    # A draft count per request measured in this many steps is priced at its own mean rather than
    # the line's: a step's cost need not rise with its drafts (at batch 1 on the Zen 4 box one
    # draft token cost 5-7 ms more than 2-5, in three runs: bench/RESULTS.md, thirty-seventh
    # session), and a line through such means prices every chain at their average.
    MEASURED_POINTS = 24

    def __init__(self) -> None:
        self.speed = 1.0                        # raw ms / normalized ms (see the module)
        self.steps = 0                          # target steps added (the means' clock, _Line.last)
        self.plain: Dict[int, _Line] = {}       # x = 0 always: the level
        self.target: Dict[int, _Line] = {}      # x = draft tokens per request (> 0)
        self.draft: Dict[int, _Line] = {}
        self.warm: Dict[int, _Line] = {}        # x = 0 always: the level (optional in saved files)
        self.frozen = False          # True: no learning; a bucket never measured borrows the nearest one

    @staticmethod
    def bucket(batch_size: int) -> int:
        return FittedPolicy.bucket(batch_size)

    def _line(self, table: Dict[int, _Line], batch_size: int) -> _Line:
        b = self.bucket(batch_size)
        if self.frozen and not (b in table and table[b].known):
            near = self.nearest_ready(batch_size)
            if near is not None and near in table:     # (the optional warm line may lack it)
                return table[near]
        return table.setdefault(b, _Line())

    # -- learning ----------------------------------------------------------------------------
    def normalize(self, ms: float) -> float:
        """Raw milliseconds measured now -> normalized ones (the units of every prediction)."""
        return float(ms) / self.speed

    def add_target(self, batch_size: int, tokens: int, ms: float) -> None:
        """A step whose target forward ran ``tokens`` tokens (``batch_size`` of them: no drafts),
        in ``ms`` raw milliseconds: first the speed, from this step against its kind's settled
        mean, then the normalized time joins the line."""
        x = max(0.0, float(tokens - batch_size) / batch_size)
        line = self._line(self.plain if x <= 0 else self.target, batch_size)
        mean = line.settled(x)
        if mean is not None:
            r = min(max(float(ms) / (self.speed * mean), 1.0 / self.SPEED_STEP), self.SPEED_STEP)
            self.speed *= r ** (1.0 - self.SPEED_KEEP)
        self.steps += 1
        self._add(line, x, ms)

    def _add(self, line: _Line, x: float, ms: float) -> None:
        """``ms`` raw -> normalized, into ``line``'s mean at ``x`` with the weight of the steps
        since that mean's last point (see ``MEAN_KEEP``)."""
        key = line.key(x)
        since = self.steps - line.last.get(key, self.steps - 10 ** 6)
        line.last[key] = self.steps
        line.add(x, self.normalize(ms), max(1.0 - self.MEAN_WEIGHT, self.MEAN_KEEP ** max(since, 1)))

    def add_draft(self, batch_size: int, steps: int, ms: float) -> None:
        """The draft's forwards of one step (``steps`` after the first), ``ms`` raw."""
        self._add(self._line(self.draft, batch_size), float(steps), ms)

    def add_warm(self, batch_size: int, ms: float) -> None:
        """A plain step's warm draft forward (the draft's first forward, no logits, no drafts), raw ms."""
        self._add(self._line(self.warm, batch_size), 0.0, ms)

    def predict_target(self, batch_size: int, tokens: int) -> Optional[float]:
        """What a step of ``tokens`` tokens should take now, in raw milliseconds (None before any
        step of its kind)."""
        x = float(tokens - batch_size) / batch_size
        line = (self.plain if x <= 0 else self.target).get(self.bucket(batch_size))
        ms = None if line is None else line.at(max(0.0, x))
        return None if ms is None else ms * self.speed

    def state(self, batch_size: int) -> Tuple[int, int, int, bool, bool]:
        """(plain steps, speculative steps, draft calls observed, speculative slope known, draft
        slope known)."""
        b = self.bucket(batch_size)
        p, t, d = self.plain.get(b), self.target.get(b), self.draft.get(b)
        return (p.n if p else 0, t.n if t else 0, d.n if d else 0, bool(t and t.ready), bool(d and d.ready))

    def draft_first_measured(self, batch_size: int) -> bool:
        """Whether the draft's first forward alone (a 1-token step, no loop) was measured here."""
        line = self.draft.get(self.bucket(batch_size))
        return line is not None and line.key(0.0) in line.means

    # -- saved between processes -------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": self.FORMAT, "speed": self.speed,
                **{name: {str(b): v.to_list() for b, v in getattr(self, name).items()}
                   for name in ("plain", "target", "draft", "warm")}}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCosts":
        c = cls()
        try:
            if d.get("format") != cls.FORMAT:
                raise ValueError(f"format {d.get('format')!r}, this version reads format {cls.FORMAT}")
            for name in ("plain", "target", "draft", "warm"):
                if name == "warm" and name not in d:
                    continue             # saved before warm steps were timed: learned again
                setattr(c, name, {int(b): _Line.from_list(v) for b, v in d[name].items()})
            # (files saved before the speed was kept: their means are raw, speed 1)
            c.speed = float(d.get("speed", 1.0))
            if not 0.0 < c.speed < float("inf"):
                raise ValueError(f"speed {c.speed!r}")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a saved vLLM step-cost model: {e}") from None
        return c

    def save(self, path: str) -> None:
        from .._io import write_json_atomic
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str) -> "StepCosts":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def slopes(self, batch_size: int) -> Optional[Tuple[float, float]]:
        """(ms per draft token per request of a speculative step, ms per draft forward after the
        first) at ``batch_size``: what one more draft token costs (:mod:`.pathstop`). None until
        both slopes were measured."""
        target, draft = self._line(self.target, batch_size), self._line(self.draft, batch_size)
        if not (target.ready and draft.ready):
            return None
        return float(target.slope), float(draft.slope)

    def nearest_ready(self, batch_size: int) -> Optional[int]:
        """The bucket closest to ``batch_size``'s with all three costs measured (frozen costs)."""
        ready = [b for b in self.plain if self.plain[b].known and b in self.target and self.target[b].known
                 and b in self.draft and self.draft[b].known]
        if not ready:
            return None
        want = self.bucket(batch_size)
        return min(ready, key=lambda b: (abs(b - want), b))

    # -- the cost-model interface of heterospec.policy.fit_plan ------------------------------
    def plain_level(self, batch_size: int) -> float:
        """A plain step's target side alone (a step of a bucket whose drafter is off)."""
        return self._line(self.plain, batch_size).at(0.0) or 1.0

    def warm_ms(self, batch_size: int) -> float:
        """The warm draft forward of a plain step; 0 until measured."""
        return self._line(self.warm, batch_size).at(0.0) or 0.0

    def plain_ms(self, batch_size: int, context: int = 0) -> float:
        """The plain step speculation is weighed against: a warm one (see the module)."""
        return self.plain_level(batch_size) + self.warm_ms(batch_size)

    def verify_ms(self, batch_size: int, nodes: float, context: int = 0) -> float:
        """Target step with ``nodes`` tokens per request (root included) on average: the measured
        mean of that many drafts per request where it was measured in ``MEASURED_POINTS`` steps,
        else the speculative line."""
        if nodes <= 1.0:
            return self.plain_level(batch_size)
        line, x = self._line(self.target, batch_size), float(nodes) - 1.0
        return line.measured(x, self.MEASURED_POINTS) or line.at(x) or self.plain_level(batch_size)

    def marginal_verify_ms(self, batch_size: int, limit: int) -> Optional[List[float]]:
        """Per draft position ``j = 1..limit``: what its token adds to the target step, ms per draft
        token per request (:mod:`.pathstop`): ``verify(j + 1) - verify(j)`` nodes, position 1 the
        speculative slope (its token's worth is decided by the bins). None until the slope was
        measured. Negative where a longer chain was measured cheaper."""
        target = self._line(self.target, batch_size)
        if not target.ready:
            return None
        out = [float(target.slope)]
        for j in range(2, int(limit) + 1):
            out.append(self.verify_ms(batch_size, j + 1.0) - self.verify_ms(batch_size, float(j)))
        return out

    def draft_ms(self, batch_size: int, steps: float, extend_tokens: float = 1.0) -> float:
        return self._line(self.draft, batch_size).at(float(steps)) or 0.0
