"""Speculative-decoding settings: the EAGLE-2 dynamic tree and HeteroSpec's per-bin actions.

Names follow the EAGLE repository (``top_k``, ``depth``, ``total_tokens``) and the HeteroSpec paper
(``alpha``, ``gamma``, aggressive bins). Every choice the paper leaves open is a field here, with the
reading we default to documented next to it (see ``../shared/reference/heterospec-method.md`` §8).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass
from typing import Optional, Tuple

PSTAR_POOLS = ("final_layer", "frontier")
CALIBRATION_LABELS = ("tcr", "pstar_rank")


def _as_int(owner: str, name: str, value, *, optional: bool = False):
    """An integer setting (numpy integers welcome); bools, floats and strings are errors rather
    than being truncated or compared later in some unrelated place."""
    if value is None and optional:
        return None
    if not isinstance(value, bool) and hasattr(value, "__index__"):
        try:
            return operator.index(value)
        except TypeError:       # e.g. a tensor of several elements, or a float one
            pass
    raise ValueError(f"{owner}: {name} must be an int{' or None' if optional else ''}, "
                     f"got {type(value).__name__} {value!r}")


def _as_float(owner: str, name: str, value) -> float:
    """A real-number setting (ints welcome); bools and strings are errors."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{owner}: {name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


@dataclass
class SpecConfig:
    """Tree shape and HeteroSpec policy.

    EAGLE-2 tree (both speculative methods)
        top_k: children proposed per expanded node, and frontier width per layer.
        depth: tree-expansion draft forwards per round; the tree has ``depth + 1`` candidate layers
            (the EAGLE repo's ``depth``; the paper's "depth 8" is ``depth=7``).
        total_tokens: nodes sent to verification, **root included** (EAGLE's ``total_token``).

    HeteroSpec (method="heterospec" only)
        alpha: extra-depth scale; DED drafts ``depth + alpha - i`` layers in aggressive bin ``i``.
            ``None`` means the paper's default ``ceil(depth / 2)``.
        gamma: Top-N factors of the aggressive bins, lowest entropy first. TNP verifies
            ``round(gamma[i] * total_tokens + alpha - i)`` nodes (root included) in bin ``i``.
        aggressive_bins: how many of the lowest-entropy bins get DED and TNP (the paper: 3 of 8).
        entropy_k: K of the Top-K entropy; ``None`` reuses ``top_k`` (free: the top-k is computed
            for expansion anyway).
        pstar_pool: which candidates compete for P* (the path with the highest final-token
            confidence): ``"final_layer"`` = all ``top_k**2`` candidates of the deepest layer after
            the base ``depth`` expansions, ``"frontier"`` = only the ``top_k`` best of them.
    """

    top_k: int = 10
    depth: int = 7
    total_tokens: int = 60
    alpha: Optional[int] = None
    gamma: Tuple[float, ...] = (0.3, 0.6, 1.0)
    aggressive_bins: int = 3
    entropy_k: Optional[int] = None
    pstar_pool: str = "final_layer"

    def __post_init__(self) -> None:
        for name in ("top_k", "depth", "total_tokens", "aggressive_bins"):
            setattr(self, name, _as_int("SpecConfig", name, getattr(self, name)))
        for name in ("alpha", "entropy_k"):
            setattr(self, name, _as_int("SpecConfig", name, getattr(self, name), optional=True))
        if isinstance(self.gamma, (str, bytes)) or not hasattr(self.gamma, "__iter__"):
            raise ValueError(f"SpecConfig: gamma must be a sequence of numbers (one per aggressive bin), "
                             f"got {self.gamma!r}")
        self.gamma = tuple(_as_float("SpecConfig", "gamma", g) for g in self.gamma)
        if not all(math.isfinite(g) for g in self.gamma):
            raise ValueError(f"SpecConfig: gamma factors must be finite, got {self.gamma}")
        if self.top_k < 1 or self.top_k > 64:
            raise ValueError(f"SpecConfig: top_k must be in [1, 64], got {self.top_k}")
        if self.depth < 0:
            raise ValueError(f"SpecConfig: depth must be >= 0, got {self.depth}")
        if self.total_tokens < 1:
            raise ValueError(f"SpecConfig: total_tokens counts the root and must be >= 1, got {self.total_tokens}")
        if self.alpha is not None and self.alpha < 0:
            raise ValueError(f"SpecConfig: alpha must be >= 0, got {self.alpha}")
        if self.aggressive_bins < 0 or self.aggressive_bins > len(self.gamma):
            raise ValueError(f"SpecConfig: aggressive_bins must be in [0, len(gamma)={len(self.gamma)}], "
                             f"got {self.aggressive_bins}")
        if any(g <= 0 for g in self.gamma):
            raise ValueError(f"SpecConfig: gamma factors must be > 0, got {self.gamma}")
        if self.pstar_pool not in PSTAR_POOLS:
            raise ValueError(f"SpecConfig: pstar_pool must be one of {PSTAR_POOLS}, got {self.pstar_pool!r}")
        k = self.entropy_k if self.entropy_k is not None else self.top_k
        if k < 1 or k > 64:
            raise ValueError(f"SpecConfig: entropy_k must be in [1, 64], got {k}")
        if self.entropy_k is not None and self.entropy_k < self.top_k:
            raise ValueError(f"SpecConfig: entropy_k ({self.entropy_k}) must be >= top_k ({self.top_k}): "
                             "the same top-K pass proposes the children")

    # Derived values -------------------------------------------------------------------------
    @property
    def resolved_alpha(self) -> int:
        return self.alpha if self.alpha is not None else math.ceil(self.depth / 2)

    @property
    def resolved_entropy_k(self) -> int:
        return self.entropy_k if self.entropy_k is not None else self.top_k

    def bin_actions(self, num_bins: int) -> Tuple[list, list]:
        """Per-bin (extra draft depth, verified nodes incl. root) for ``num_bins`` entropy bins."""
        alpha = self.resolved_alpha
        extra, nodes = [], []
        for i in range(num_bins):
            if i < self.aggressive_bins:
                extra.append(max(alpha - i, 0))
                n = math.floor(self.gamma[i] * self.total_tokens + (alpha - i) + 0.5)
                nodes.append(max(n, 1))
            else:
                extra.append(0)
                nodes.append(self.total_tokens)
        return extra, nodes

    def replace(self, **changes) -> "SpecConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Official EAGLE-3 settings (EaModel.from_pretrained defaults; the paper's 7-8B settings).
OFFICIAL = SpecConfig(top_k=10, depth=7, total_tokens=60)

# CPU: verifying a token costs real compute (on the 2-core dev box, SmolLM2 verifying 8 tree
# tokens takes ~1.4x a one-token step, 16 ~1.7x, 24 ~2x), so trees are small. Chosen by a grid
# over (top_k, depth, total_tokens) of eagle3 tokens/s on calibration prompts (disjoint from the
# benchmark sets), interleaved with autoregressive: (4, 3, 8) was fastest (1.15x AR, tau 2.31);
# (6, 5, 16) reached tau 2.61 but 0.97x. See bench/RESULTS.md ("Device-aware budgets").
CPU_DEFAULT = SpecConfig(top_k=4, depth=3, total_tokens=8)


def default_config(device) -> SpecConfig:
    """The tree settings we ship for a device: official EAGLE-3 on GPU, a smaller tree on CPU."""
    kind = getattr(device, "type", str(device)).split(":")[0]
    return OFFICIAL if kind == "cuda" else CPU_DEFAULT


@dataclass
class SamplingParams:
    """How the target's distribution is processed; temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        self.temperature = _as_float("sampling", "temperature", self.temperature)
        self.top_p = _as_float("sampling", "top_p", self.top_p)
        self.top_k = _as_int("sampling", "top_k", self.top_k)
        self.seed = _as_int("sampling", "seed", self.seed, optional=True)
        if not (self.temperature >= 0.0) or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


__all__ = ["SpecConfig", "SamplingParams", "OFFICIAL", "CPU_DEFAULT", "default_config",
           "PSTAR_POOLS", "CALIBRATION_LABELS"]
