"""Wall-clock timing that is correct on CUDA.

CUDA kernels run asynchronously: ``time.perf_counter()`` around them measures the launches, not
the work. Two ways to time a stage:

* :func:`timestamp` synchronises the device, then reads ``perf_counter`` (host wall clock; one
  host sync per call on CUDA, so use it only when timing is asked for).
* :class:`StageTimer` with ``sync=False`` records CUDA events at each mark (no host sync) and
  turns them into seconds when read, after the caller's own synchronisation (e.g. the round's
  single device-to-host read): device time between marks, free of host overhead. On CPU (or with
  ``sync=True``) it uses :func:`timestamp`.

While a CUDA graph is being captured nothing here synchronises or records (capture forbids
host syncs; time the replay instead).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["synchronize", "timestamp", "StageTimer", "STALL_FACTOR", "unstalled"]

#: A round or step timed at more than this times what was expected of it counts as this many
#: times: a stall (a garbage collection, another process, a one-off of the process) is not the
#: device's speed. The time corrections that learn from these timings are capped at this factor
#: anyway, but they average over hundreds of rounds, and one uncapped stall - a 190 ms round of a
#: process's first call, priced at 11 - taught a fresh policy that rounds cost 2.7x the model,
#: and batch 1 stopped speculating for good (bench/RESULTS.md, sixty-fourth session).
STALL_FACTOR = 3.0


def unstalled(measured: float, expected: float) -> float:
    """``measured``, at most :data:`STALL_FACTOR` times ``expected`` (where that is positive)."""
    return min(measured, STALL_FACTOR * expected) if expected > 0 else measured


def _cuda_device(device) -> Optional[torch.device]:
    if device is None:
        return None
    d = torch.device(device) if not isinstance(device, torch.device) else device
    return d if d.type == "cuda" else None


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def synchronize(device) -> None:
    """Wait until the work queued on ``device`` has finished (``torch.cuda.synchronize`` on a
    CUDA device; nothing on CPU or meta, or while a CUDA graph is being captured)."""
    d = _cuda_device(device)
    if d is not None and not _capturing():
        torch.cuda.synchronize(d)


def timestamp(device) -> float:
    """``time.perf_counter()`` after :func:`synchronize` ``(device)``: differences of two
    timestamps measure the device work between them."""
    synchronize(device)
    return time.perf_counter()


class StageTimer:
    """Durations of consecutive stages of a round.

    ``t = StageTimer(device)``; ``t.mark("draft")`` after the draft, ``t.mark("verify")`` after
    the verification, ...; ``t.laps()`` -> ``{"draft": s, "verify": s}`` (seconds since the
    previous mark, or since construction / :meth:`reset` for the first).

    device : the device whose work is timed. sync : on CUDA, ``False`` (default) records CUDA
    events (no host sync; :meth:`laps` synchronises on the last event only if the caller has not
    synchronised yet), ``True`` synchronises at every mark and uses the host clock. On CPU the
    host clock is always used (nothing to synchronise).
    """

    def __init__(self, device, sync: bool = False):
        self.device = _cuda_device(device)
        self.use_events = self.device is not None and not sync
        self._marks: List[Tuple[str, object]] = []
        self.reset()

    def _stamp(self):
        if self.use_events:
            if _capturing():
                return None
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return timestamp(self.device)

    def reset(self) -> None:
        """Start a new round: forget the marks, restart the clock."""
        self._start = self._stamp()
        self._marks = []

    def mark(self, name: str) -> None:
        """End the stage ``name`` now."""
        self._marks.append((name, self._stamp()))

    def laps(self) -> Dict[str, float]:
        """Seconds per stage, in mark order (a repeated name accumulates)."""
        out: Dict[str, float] = {}
        prev = self._start
        if self.use_events and self._marks and self._marks[-1][1] is not None:
            self._marks[-1][1].synchronize()  # a no-op wait if the round already synchronised
        for name, cur in self._marks:
            if prev is None or cur is None:
                dt = float("nan")  # recorded during a graph capture
            elif self.use_events:
                dt = prev.elapsed_time(cur) / 1e3
            else:
                dt = cur - prev
            out[name] = out.get(name, 0.0) + dt
            prev = cur
        return out

    def total(self) -> float:
        """Seconds from the start to the last mark."""
        return sum(self.laps().values())
