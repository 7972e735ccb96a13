"""Entropy bins and the per-bin actions of HeteroSpec.

The cumulative meta-path Top-K entropy of a draft round, ``H(P*)``, is quantised by the edges of a
depth-3 CART regression tree (fitted by :mod:`heterospec.calibrate`). Bin 0 is the lowest entropy.
What each bin does is decided by a policy (:mod:`heterospec.policy`): the paper's formulas or
actions fitted to measured acceptance and cost.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings
from dataclasses import dataclass, field
from typing import List, Optional


from .config import SpecConfig

BINS_FILENAME = "entropy_bins.json"


def bins_tag(config: SpecConfig) -> str:
    """The tree tag of a bins file: H(P*) sums ``depth + 1`` per-step entropies of the top K, so
    bins hold for one (depth, K)."""
    return f"d{config.depth}_k{config.resolved_entropy_k}"


def bins_path_to_write(out_dir: str, config: SpecConfig) -> str:
    """Where calibrated bins for ``config``'s tree are saved (see ``_io.tree_file_to_write``)."""
    from ._io import tree_file_to_write

    def same(d):
        tree = (d.get("provenance") or {}).get("tree") or {}
        return (tree.get("depth"), tree.get("entropy_k")) == (config.depth, config.resolved_entropy_k)
    return tree_file_to_write(out_dir, BINS_FILENAME, bins_tag(config), same)


# Fallback edges when no calibration file exists, as fractions of the largest possible path
# entropy (depth + 1) * log(K): a conservative guess that puts only very peaked rounds in the
# aggressive bins. Calibrate for real use (`heterospec calibrate`).
FALLBACK_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6)


@dataclass
class EntropyBins:
    """Ascending bin edges (``len(edges) + 1`` bins) and where they came from."""

    edges: List[float]
    provenance: dict = field(default_factory=dict)
    bin_mean_rank: Optional[List[float]] = None
    bin_counts: Optional[List[int]] = None

    def __post_init__(self) -> None:
        if isinstance(self.edges, (str, bytes, dict)) or not hasattr(self.edges, "__iter__"):
            raise ValueError(f"EntropyBins: edges must be a list of numbers, got {type(self.edges).__name__} "
                             f"{self.edges!r}")
        self.edges = list(self.edges)
        if any(isinstance(e, bool) or not isinstance(e, numbers.Real) for e in self.edges):
            raise ValueError(f"EntropyBins: edges must be numbers, got {self.edges!r}")
        if not isinstance(self.provenance, dict):
            raise ValueError(f"EntropyBins: provenance must be a dict, got {type(self.provenance).__name__}")
        tree = self.provenance.get("tree")
        if tree is not None and not isinstance(tree, dict):
            raise ValueError(f"EntropyBins: provenance['tree'] must be a dict, got {type(tree).__name__}")
        self.edges = [float(e) for e in self.edges]
        if any(not math.isfinite(e) for e in self.edges):
            raise ValueError(f"EntropyBins: edges must be finite, got {self.edges}")
        if any(b <= a for a, b in zip(self.edges, self.edges[1:])):
            raise ValueError(f"EntropyBins: edges must be strictly ascending, got {self.edges}")

    @property
    def num_bins(self) -> int:
        return len(self.edges) + 1

    @property
    def is_fallback(self) -> bool:
        return bool(self.provenance.get("fallback"))

    def bin_of(self, entropy: float) -> int:
        """Python-side bin lookup with the op's rule: count edges strictly below ``entropy``."""
        if math.isnan(entropy):
            return self.num_bins - 1
        return sum(1 for e in self.edges if entropy > e)

    @classmethod
    def fallback(cls, config: SpecConfig) -> "EntropyBins":
        top = (config.depth + 1) * math.log(config.resolved_entropy_k) if config.resolved_entropy_k > 1 else 1.0
        edges = [f * top for f in FALLBACK_FRACTIONS]
        return cls(edges, provenance={"fallback": True,
                                      "rule": f"edges = (depth+1)*log(K) * {list(FALLBACK_FRACTIONS)}",
                                      "depth": config.depth, "K": config.resolved_entropy_k})

    def to_dict(self) -> dict:
        return {"edges": self.edges, "bin_mean_rank": self.bin_mean_rank, "bin_counts": self.bin_counts,
                "provenance": self.provenance}

    def save(self, path: str) -> None:
        from ._io import write_json_atomic
        write_json_atomic(path, self.to_dict(), indent=2)

    @classmethod
    def load(cls, path: str) -> "EntropyBins":
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"entropy bins file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"entropy bins file {path} is not valid JSON: {e}") from None
        if not isinstance(data, dict) or "edges" not in data:
            raise ValueError(f"entropy bins file {path} has no 'edges' list")
        try:
            return cls(data["edges"], provenance=data.get("provenance") or {},
                       bin_mean_rank=data.get("bin_mean_rank"), bin_counts=data.get("bin_counts"))
        except ValueError as e:
            raise ValueError(f"entropy bins file {path}: {e}") from None

    @classmethod
    def find(cls, draft_dir: Optional[str], config: SpecConfig, quiet: bool = False) -> "EntropyBins":
        """The calibrated bins next to the draft (``entropy_bins_d<depth>_k<K>.json`` for this tree
        when present, else ``entropy_bins.json``), else the documented fallback (with a warning)."""
        from ._io import find_tree_file

        path = find_tree_file(draft_dir, BINS_FILENAME, bins_tag(config))
        if path:
            return cls.load(path)
        if not quiet:
            warnings.warn(f"no {BINS_FILENAME} next to the draft ({draft_dir or 'in-memory draft'}): "
                          "HeteroSpec uses fallback entropy bins; run `heterospec calibrate` to fit "
                          "them for this model pair", stacklevel=2)
        return cls.fallback(config)
