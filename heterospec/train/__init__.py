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

__all__ = ["prompts", "distill", "trainer", "cli", "disjoint", "main", "deepest_draft_layers",
           "default_ttt_steps"]


def deepest_draft_layers() -> int:
    """Candidate layers of the deepest draft tree the engine builds with its shipped configs.

    A tree of ``depth`` expansions has ``depth + 1`` candidate layers (layer 0 from ``extend``,
    layer d from the d-th ``tree_step``); HeteroSpec's DED adds up to ``alpha`` expansions in
    its most confident bin. Over ``config.OFFICIAL`` (10, 7, 60) and ``config.CPU_DEFAULT``
    (4, 3, 8): 7 + 1 + ceil(7 / 2) = 12. Training-time-test step s trains layer s, so this is
    the TTT step count at which every layer the engine drafts is a trained position."""
    from ..config import CPU_DEFAULT, OFFICIAL

    deepest = 0
    for cfg in (OFFICIAL, CPU_DEFAULT):
        extra, _ = cfg.bin_actions(max(cfg.aggressive_bins, 1) + 1)
        deepest = max(deepest, cfg.depth + 1 + max(extra))
    return deepest


def default_ttt_steps() -> int:
    """The trainer's default TTT step count: ``deepest_draft_layers()`` (and at least 7, EAGLE-3's)."""
    return max(7, deepest_draft_layers())


def main(argv=None) -> int:
    """``heterospec train-draft ARGS``: see ``heterospec.train.cli``."""
    from .cli import main as _main

    return _main(argv)
