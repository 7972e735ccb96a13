"""Data-driven entropy partitioning: fit HeteroSpec's entropy bins on calibration traces.

Run the ``eagle3`` method (the unmodified tree) on calibration prompts, record per round the
cumulative meta-path Top-K entropy ``H(P*)`` and a rank label, and fit a depth-3 CART regression
tree (scikit-learn ``DecisionTreeRegressor``) of rank on entropy. Its thresholds are the bin edges
(up to 7 edges, 8 bins). Two label readings of the paper are offered (``heterospec-method.md``
§4.2):

* ``"tcr"`` (default): every round; the label is the terminal confidence rank, the rank (by
  cumulative score, 1 = best) of the deepest accepted node among the verified nodes; a round that
  accepts nothing gets ``verified nodes`` (worse than any selected rank).
* ``"pstar_rank"``: only rounds in which P* was accepted in full (the paper's literal reading);
  the label is the rank of P*'s final node among the verified nodes.

Only the edges are used online; the per-bin mean rank is saved to check the bins' premise, that
rank rises with entropy (a warning says when it does not).
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .config import CALIBRATION_LABELS
from .entropy import BINS_FILENAME, EntropyBins


def traces_from_records(records: Iterable, label: str = "tcr") -> Tuple[np.ndarray, np.ndarray]:
    """(entropy, rank) pairs from :class:`heterospec.engine.RoundRecord` objects."""
    if label not in CALIBRATION_LABELS:
        raise ValueError(f"unknown calibration label {label!r}; choose one of {CALIBRATION_LABELS}")
    xs, ys = [], []
    for r in records:
        if label == "tcr":
            xs.append(r.entropy)
            ys.append(r.tcr)
        elif r.pstar_accepted and r.pstar_rank > 0:
            xs.append(r.entropy)
            ys.append(r.pstar_rank)
    return np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)


def fit_bins(entropy: Sequence[float], rank: Sequence[float], max_depth: int = 3,
             min_samples_leaf: Optional[int] = None, provenance: Optional[dict] = None) -> EntropyBins:
    """Fit a CART regression tree of ``rank`` on ``entropy``; its thresholds become the bin edges."""
    from sklearn.tree import DecisionTreeRegressor

    x = np.asarray(entropy, dtype=np.float64).reshape(-1, 1)
    y = np.asarray(rank, dtype=np.float64)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"fit_bins: {x.shape[0]} entropies but {y.shape[0]} ranks")
    if x.shape[0] < 2 ** max_depth:
        raise ValueError(f"fit_bins: need at least {2 ** max_depth} calibration rounds for a depth-{max_depth} "
                         f"tree, got {x.shape[0]}")
    if not np.all(np.isfinite(x)) or not np.all(np.isfinite(y)):
        raise ValueError("fit_bins: entropies and ranks must be finite")
    leaf = min_samples_leaf if min_samples_leaf is not None else max(1, x.shape[0] // 100)
    tree = DecisionTreeRegressor(max_depth=max_depth, min_samples_leaf=leaf, random_state=0).fit(x, y)
    t = tree.tree_
    edges = sorted({float(v) for f, v in zip(t.feature, t.threshold) if f >= 0})
    bins = EntropyBins(edges, provenance=dict(provenance or {}))
    idx = np.array([bins.bin_of(float(v)) for v in x[:, 0]])
    bins.bin_counts = [int((idx == i).sum()) for i in range(bins.num_bins)]
    bins.bin_mean_rank = [float(y[idx == i].mean()) if (idx == i).any() else None for i in range(bins.num_bins)]
    bins.provenance.setdefault("samples", int(x.shape[0]))
    bins.provenance.setdefault("cart", {"max_depth": max_depth, "min_samples_leaf": leaf,
                                        "criterion": "squared_error (size-weighted SSE)"})
    return bins


def rank_rises_with_entropy(bins: EntropyBins) -> bool:
    """True when the mean rank never falls from a lower-entropy bin to a higher one."""
    means = [m for m in (bins.bin_mean_rank or []) if m is not None]
    return all(b >= a for a, b in zip(means, means[1:]))


def _where(path) -> Optional[str]:
    """A model location for the provenance record: package-relative for the shipped assets,
    ``~``-relative under the home directory, so a shipped bins file names no build machine."""
    if path is None or not os.path.exists(str(path)):
        return None if path is None else str(path)   # e.g. "hf_model" for an in-memory target
    path = os.path.abspath(str(path))
    pkg = os.path.dirname(os.path.abspath(__file__))
    if path.startswith(pkg + os.sep):
        return "heterospec/" + os.path.relpath(path, pkg)
    home = os.path.expanduser("~")
    return "~/" + os.path.relpath(path, home) if path.startswith(home + os.sep) else path


def calibrate(engine, prompts: Sequence, max_new_tokens: int = 128, label: str = "tcr",
              source: str = "user prompts", out_dir: Optional[str] = None, progress: bool = True,
              chat: bool = True) -> EntropyBins:
    """Fit entropy bins for ``engine``'s model pair and (optionally) save them next to the draft.

    Runs ``eagle3`` greedily on each prompt, collects the per-round records, fits the CART bins and
    sets them on the engine. With ``out_dir`` the bins are written to ``out_dir/entropy_bins.json``.
    """
    from tqdm.auto import tqdm

    if not prompts:
        raise ValueError("calibrate: no calibration prompts given")
    records: List = []
    bar = tqdm(prompts, desc="calibrating (eagle3 rounds)", disable=not progress, unit="prompt")
    for i, p in enumerate(bar):
        try:
            res = engine.generate(p, max_new_tokens=max_new_tokens, method="eagle3", chat=chat)
        except ValueError as e:
            raise ValueError(f"calibration prompt {i}: {e}") from e
        records.extend(res.stats.records)
        bar.set_postfix(rounds=len(records))
    x, y = traces_from_records(records, label)
    cfg = engine.config
    provenance = {
        "target": _where(getattr(engine.target, "name_or_path", None)),
        "draft": _where(engine.draft_dir),
        "prompt_source": source,
        "prompts": len(prompts),
        "rounds": len(records),
        "label": label,
        "max_new_tokens": max_new_tokens,
        "tree": {"top_k": cfg.top_k, "depth": cfg.depth, "total_tokens": cfg.total_tokens,
                 "entropy_k": cfg.resolved_entropy_k, "pstar_pool": cfg.pstar_pool},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import sklearn
        provenance["sklearn"] = sklearn.__version__
    except ImportError:  # pragma: no cover - fit_bins raises first
        pass
    bins = fit_bins(x, y, provenance=provenance)
    bins.provenance["rank_rises_with_entropy"] = rank_rises_with_entropy(bins)
    if not bins.provenance["rank_rises_with_entropy"]:
        warnings.warn(f"calibration: mean rank does not rise with entropy across bins "
                      f"({bins.bin_mean_rank}); the bins' premise is weak for this model pair", stacklevel=2)
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        bins.save(os.path.join(out_dir, BINS_FILENAME))
    engine.bins = bins
    return bins
