"""EAGLE-3 draft training for the built-in target (self-distillation on CPU or GPU).

* ``heterospec.train.prompts``: training prompts, disjoint from the benchmark sets.
* ``heterospec.train.distill``: target self-distillation into resumable shards (taps + final
  hidden state per token).
* ``heterospec.train.trainer``: draft vocabulary, training-time-test trainer, offline
  acceptance simulation, export in the public EAGLE-3 format.
* ``heterospec.train.cli``: ``heterospec train-draft`` / ``scripts/train_draft.py``.

Submodules are imported on use (``from heterospec.train import trainer``) so that importing the
package stays cheap.
"""

__all__ = ["prompts", "distill", "trainer", "cli", "main"]


def main(argv=None) -> int:
    """``heterospec train-draft ARGS``: see ``heterospec.train.cli``."""
    from .cli import main as _main

    return _main(argv)
