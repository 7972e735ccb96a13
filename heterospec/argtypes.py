"""argparse ``type=`` functions shared by the ``heterospec`` CLI and ``heterospec train-draft``.

Each raises ``argparse.ArgumentTypeError``, which argparse reports as ``PROG: error: argument
--FLAG: MESSAGE`` with exit status 2, so bad numbers are refused before any model loads. No torch
import here: ``scripts/train_draft.py`` uses these without the compiled extension.
"""

from __future__ import annotations

import argparse
import math

SEED_MAX = 2 ** 63 - 1


def int_at_least(lo: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {v}")
        return v
    parse.__name__ = f"int>={lo}"
    return parse


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)


def _number(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {s}")
    return v


def nonneg_float(s: str) -> float:
    v = _number(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {s}")
    return v


def positive_float(s: str) -> float:
    v = _number(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
    return v


def fraction(s: str) -> float:
    v = _number(s)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {s}")
    return v


def probability(s: str) -> float:
    v = _number(s)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s}")
    return v


def seed(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {s!r}") from None
    if not 0 <= v <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63-1], got {s}")
    return v
