"""Shared by this directory's scripts: the time spent inside the models' forwards, and timers on
chosen functions (monkeypatched wrappers; measurement only)."""
import collections
import functools
import time


def forward_clock(eng) -> list:
    """Wrap the target's forward and the draft's extend / tree_step / logits (class-wide). Returns a
    one-item list that accumulates the seconds spent inside them (nested calls counted once);
    reset it with ``clock[0] = 0.0``."""
    inside, depth = [0.0], [0]

    def wrap(obj, name):
        f = getattr(obj, name)

        @functools.wraps(f)
        def g(*a, **k):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    inside[0] += time.perf_counter() - t
        setattr(obj, name, g)

    wrap(type(eng.target), "forward")
    for name in ("extend", "tree_step", "logits"):
        wrap(type(eng.draft), name)
    return inside


class Timers:
    """Seconds and calls per label of the functions wrapped with :meth:`wrap`."""

    def __init__(self):
        self.acc = collections.defaultdict(float)
        self.cnt = collections.Counter()

    def wrap(self, obj, name, label=None):
        f, label = getattr(obj, name), label or name

        @functools.wraps(f)
        def g(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.acc[label] += time.perf_counter() - t
                self.cnt[label] += 1
        setattr(obj, name, g)

    def clear(self):
        self.acc.clear()
        self.cnt.clear()
