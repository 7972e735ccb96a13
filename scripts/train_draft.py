#!/usr/bin/env python
"""Train the EAGLE-3 draft for the built-in target (SmolLM2-135M-Instruct).

Steps (each resumable; run them in order, or ``all``):

    python scripts/train_draft.py distill  [--out DIR] [--num-prompts N] [--time-budget S]
    python scripts/train_draft.py vocab    [--data DIR] [--size 8192]
    python scripts/train_draft.py train    [--data DIR] [--run DIR] [--steps N] ...
    python scripts/train_draft.py simulate [--run DIR]             # offline tau estimate
    python scripts/train_draft.py export   [--run DIR] [--dest heterospec/assets/...]

Threads: every step uses ``--threads`` torch threads (default 1, so that the machine stays
usable for others); raise it (e.g. ``--threads 2``) when the box is free. Defaults put data in
``~/.cache/heterospec/distill`` and runs in ``~/.cache/heterospec/draft-runs/default``
(``$HETEROSPEC_CACHE`` overrides the root).

The library functions behind it live in ``heterospec.train`` (``distill``, ``trainer``); the
package CLI exposes the same as ``heterospec train-draft``.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def _import_heterospec():
    """Import heterospec; if its compiled extension is not built (training does not need the
    custom ops), fall back to a bare package object so the pure-Python modules still load."""
    sys.path.insert(0, str(_REPO))
    try:
        import heterospec  # noqa: F401
    except ImportError as exc:
        for k in [k for k in sys.modules if k == "heterospec" or k.startswith("heterospec.")]:
            del sys.modules[k]
        pkg = types.ModuleType("heterospec")
        pkg.__path__ = [str(_REPO / "heterospec")]
        sys.modules["heterospec"] = pkg
        print(f"note: heterospec's compiled ops unavailable ({exc}); training does not need them",
              file=sys.stderr)


def main(argv=None):
    _import_heterospec()
    from heterospec.train.cli import main as train_main

    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
