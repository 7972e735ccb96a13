"""Shared by this directory's scripts (measurement only): a float32 engine, optionally from a fresh
online state, and a log of the target's forwards."""
import functools
import glob
import os
import time

import torch

import heterospec


def engine(fresh: bool = False):
    """The built-in pair in float32 on 2 threads; ``fresh``: the fitted policy's and lookup gate's
    saved online states removed first (what a new machine starts from)."""
    torch.set_num_threads(2)
    if fresh:
        for f in glob.glob(os.path.expanduser("~/.cache/heterospec/costs/*.online-*")):
            os.remove(f)
    return heterospec.Engine.from_pretrained(dtype=torch.float32)


def log_forwards(eng, log: list, tag=None) -> None:
    """Append ``(tokens per row, seconds)`` (with ``tag`` first, if given) for every target forward."""
    cls = type(eng.target)
    f = cls.forward

    @functools.wraps(f)
    def timed(self, tokens, *a, **k):
        t = time.perf_counter()
        try:
            return f(self, tokens, *a, **k)
        finally:
            log.append((tokens.shape[1], time.perf_counter() - t) if tag is None else (tag, tokens.shape[1], time.perf_counter() - t))
    cls.forward = timed
