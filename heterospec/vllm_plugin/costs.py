"""What a vLLM engine step costs, learned from the steps themselves.

vLLM runs the target, samples, and then calls the proposer; the time from the end of one
``propose`` call to the start of the next is everything the target side of one step cost
(scheduling, the forward over the step's tokens, rejection sampling, bookkeeping), and the time
inside ``propose`` is the draft's. Per batch-size bucket two lines are fitted by exponentially
two-time-scale updates (:class:`_Line`):

    target_ms(B, T)       = a_B + s_B * (T - B)      T = tokens in the target forward
    draft_ms(B, steps)    = f_B + g_B * steps        steps = draft forwards after the first

and exposed with the interface :func:`heterospec.policy.fit_plan` expects of a cost model
(``plain_ms``, ``verify_ms``, ``draft_ms``), so the fitted policy is the same one our own engine
uses. vLLM packs the requests of a step without padding, so verification is ragged.
"""

from __future__ import annotations

import json
from typing import Dict, Optional, Tuple

from ..policy import FittedPolicy


class _Line:
    """y = level + slope * x, learned online on two time scales.

    Until the slope is identified (two distinct x seen) the points are kept and fitted by least
    squares. After that each point updates the slope from its distance to the current level
    (points with x > 0 only) and then the level from ``y - slope * x`` (every point). A long run
    at one x (e.g. plain steps, x = 0) moves the level - the step cost drifts as contexts grow -
    but leaves the slope alone, which a forgetting least-squares fit would drag towards the
    level's drift."""

    LEVEL_KEEP = 0.9       # per point: the level follows drift within ~10 points
    SLOPE_KEEP = 0.95      # per point with x > 0

    def __init__(self) -> None:
        self.level: Optional[float] = None
        self.slope: Optional[float] = None
        self.n = 0
        self._points: list = []

    def add(self, x: float, y: float) -> None:
        self.n += 1
        if self.slope is None:
            self._points.append((x, y))
            xs = [p[0] for p in self._points]
            if max(xs) - min(xs) > 1e-9:
                m = len(xs)
                mx, my = sum(xs) / m, sum(p[1] for p in self._points) / m
                sxx = sum((p[0] - mx) ** 2 for p in self._points)
                self.slope = max(0.0, sum((p[0] - mx) * (p[1] - my) for p in self._points) / sxx)
                self.level = my - self.slope * mx
                self._points = []
            else:
                self.level = sum(p[1] for p in self._points) / len(self._points)
            return
        if x > 0:
            sample = (y - self.level) / x
            self.slope = max(0.0, self.SLOPE_KEEP * self.slope + (1 - self.SLOPE_KEEP) * sample)
        self.level = self.LEVEL_KEEP * self.level + (1 - self.LEVEL_KEEP) * (y - self.slope * x)

    def at(self, x: float) -> Optional[float]:
        if self.level is None:
            return None
        return max(1e-3, self.level + (self.slope or 0.0) * x)

    @property
    def ready(self) -> bool:
        return self.slope is not None

    def to_list(self) -> list:
        return [self.level, self.slope, self.n]

    @classmethod
    def from_list(cls, v) -> "_Line":
        line = cls()
        level, slope, n = v
        line.level = None if level is None else float(level)
        line.slope = None if slope is None else float(slope)
        line.n = int(n)
        return line


class StepCosts:
    """Per batch bucket: the target step vs. its tokens and the draft vs. its forwards."""

    def __init__(self) -> None:
        self.target: Dict[int, _Line] = {}
        self.draft: Dict[int, _Line] = {}
        self.frozen = False          # True: no learning; a bucket never measured borrows the nearest one

    @staticmethod
    def bucket(batch_size: int) -> int:
        return FittedPolicy.bucket(batch_size)

    def _line(self, table: Dict[int, _Line], batch_size: int) -> _Line:
        b = self.bucket(batch_size)
        if self.frozen and not (b in table and table[b].ready):
            near = self.nearest_ready(batch_size)
            if near is not None:
                return table[near]
        return table.setdefault(b, _Line())

    # -- learning ----------------------------------------------------------------------------
    def add_target(self, batch_size: int, tokens: int, ms: float) -> None:
        self._line(self.target, batch_size).add(float(tokens - batch_size) / batch_size, ms)

    def add_draft(self, batch_size: int, steps: int, ms: float) -> None:
        self._line(self.draft, batch_size).add(float(steps), ms)

    def predict_target(self, batch_size: int, tokens: int) -> Optional[float]:
        line = self.target.get(self.bucket(batch_size))
        return None if line is None else line.at(float(tokens - batch_size) / batch_size)

    def state(self, batch_size: int) -> Tuple[int, int, bool, bool]:
        """(target observations, draft observations, target slope known, draft slope known)."""
        t = self.target.get(self.bucket(batch_size))
        d = self.draft.get(self.bucket(batch_size))
        return (t.n if t else 0, d.n if d else 0, bool(t and t.ready), bool(d and d.ready))

    # -- saved between processes -------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": 1, "target": {str(b): v.to_list() for b, v in self.target.items()},
                "draft": {str(b): v.to_list() for b, v in self.draft.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCosts":
        c = cls()
        try:
            c.target = {int(b): _Line.from_list(v) for b, v in d["target"].items()}
            c.draft = {int(b): _Line.from_list(v) for b, v in d["draft"].items()}
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

    def nearest_ready(self, batch_size: int) -> Optional[int]:
        """The bucket closest to ``batch_size``'s with both lines known (frozen costs)."""
        ready = [b for b in self.target if self.target[b].ready and b in self.draft and self.draft[b].ready]
        if not ready:
            return None
        want = self.bucket(batch_size)
        return min(ready, key=lambda b: (abs(b - want), b))

    # -- the cost-model interface of heterospec.policy.fit_plan ------------------------------
    def plain_ms(self, batch_size: int, context: int = 0) -> float:
        return self._line(self.target, batch_size).at(0.0) or 1.0

    def verify_ms(self, batch_size: int, nodes: float, context: int = 0) -> float:
        """Target step with ``nodes`` tokens per request (root included) on average."""
        return self._line(self.target, batch_size).at(float(nodes) - 1.0) or 1.0

    def draft_ms(self, batch_size: int, steps: float, extend_tokens: float = 1.0) -> float:
        return self._line(self.draft, batch_size).at(float(steps)) or 0.0
