"""Per-bin actions of HeteroSpec: which tree each round drafts and verifies.

A *policy* answers one question per round: at this batch size, where is ``H(P*)`` read, how is
it binned, and what does each bin do? The answer is a :class:`Plan`:

    decide_depth   draft forwards before ``H(P*)`` is read (the paper: the base depth ``d``)
    entropy_k      K of the Top-K entropy
    edges          the entropy bins (bin 0 = lowest entropy)
    depth[i]       total draft forwards in bin ``i`` (``depth[i] > decide_depth``: extended drafting)
    budget[i]      draft nodes verified in bin ``i``, root excluded (Top-N pruning)
    speculate      False: the round is one plain target step (no draft at all)

Three policies:

* :class:`Eagle3Policy` - the fixed EAGLE-2/3 tree, no bins.
* :class:`PaperPolicy` (``policy="paper"``) - the paper's formulas (``d + alpha - i`` forwards,
  ``gamma_i * N + alpha - i`` nodes in the three lowest bins) on calibrated CART bins.
* :class:`FittedPolicy` (``policy="fitted"``, the default when the draft ships acceptance tables)
  - every bin's action chosen to maximise expected tokens per second: the expected accepted
  length of each action comes from calibration traces (:class:`AcceptanceTables`, device
  independent, shipped with the draft); the cost of each action from a :class:`CostModel`
  measured on this device. "Plain decoding" is always one of the candidates, so on a device or
  at a batch size where speculation does not pay the policy turns it off.

Invariant of every policy (checked by :class:`Plan`): a bin that drafts beyond ``decide_depth``
verifies at least as many draft nodes as it has candidate layers, so the extended layers can be
reached (the verified set is closed under ancestors).
"""

from __future__ import annotations

import copy
import functools
import json
import math
import operator
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .config import SpecConfig
from .entropy import EntropyBins
from .timing import unstalled

POLICIES = ("fitted", "paper")
TABLES_FILENAME = "acceptance_tables.json"
# Tables for engines that draft a chain per request (vLLM's EAGLE-3 proposer): top_k = 1.
CHAIN_TABLES_FILENAME = "acceptance_tables_chain.json"
# Speculation must beat plain decoding by this factor in the cost model before it is switched on:
# a cushion for the model's error (it never sees cache effects, scheduling, host jitter).
PLAIN_MARGIN = 1.03


# ---------------------------------------------------------------------------------------------
# Plan: the decision tables of one batch size
# ---------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """What every round does at one batch size (see the module docstring)."""

    name: str
    speculate: bool = True
    decide_depth: int = 0
    entropy_k: int = 1
    edges: List[float] = field(default_factory=list)
    depth: List[int] = field(default_factory=lambda: [0])
    budget: List[int] = field(default_factory=lambda: [0])
    binned: bool = True
    expected: Optional[dict] = None      # the cost model's prediction (fitted plans only)
    predicted_accept: Optional[List[float]] = None   # per bin: expected accepted drafts (fitted)
    # per bin: the tables' P(accepted >= j), j = 1.., of the bin's action, before any online
    # correction (fitted; what FittedPolicy.observe compares each request's accepted length with)
    survival: Optional[List[List[float]]] = None
    alternative: Optional["Plan"] = None  # fitted: the best plan of the other kind (probe rounds)

    def __post_init__(self) -> None:
        nb = len(self.edges) + 1
        if len(self.depth) != nb or len(self.budget) != nb:
            raise ValueError(f"Plan {self.name}: {nb} bins need {nb} depths and budgets, got "
                             f"{len(self.depth)} and {len(self.budget)}")
        if self.decide_depth < 0 or self.entropy_k < 1:
            raise ValueError(f"Plan {self.name}: decide_depth must be >= 0 and entropy_k >= 1")
        for i, (d, n) in enumerate(zip(self.depth, self.budget)):
            if d < self.decide_depth:
                raise ValueError(f"Plan {self.name}: bin {i} drafts {d} forwards, fewer than the "
                                 f"{self.decide_depth} before the decision")
            if n < 0:
                raise ValueError(f"Plan {self.name}: bin {i} has a negative budget {n}")
            if d > self.decide_depth and n < d + 1:
                raise ValueError(f"Plan {self.name}: bin {i} drafts {d + 1} candidate layers but verifies "
                                 f"only {n} draft nodes: the extended layers could never be verified")
        self._tensors = None

    @property
    def num_bins(self) -> int:
        return len(self.edges) + 1

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    @property
    def max_nodes(self) -> int:
        """Largest budget (draft nodes, root excluded): the capacity of the verified tree."""
        return max(self.budget)

    def prepare(self, device) -> None:
        """Put the plan's edges, depths and budgets on ``device`` (a host-to-device copy, which a
        CUDA graph cannot capture: the engine calls this before capturing a round)."""
        dev = torch.device(device)
        if self._tensors is None or self._tensors[0].device != dev:
            self._tensors = (torch.tensor(self.edges, dtype=torch.float32, device=dev),
                             torch.tensor(self.depth, dtype=torch.int64, device=dev),
                             torch.tensor(self.budget, dtype=torch.int64, device=dev))

    def tensors(self) -> tuple:
        """``(edges, depth, budget)`` on the device :meth:`prepare` put them on."""
        if self._tensors is None:
            raise ValueError(f"Plan {self.name}: prepare(device) first")
        return self._tensors

    def with_tensors(self, tensors) -> "Plan":
        """This plan deciding with ``tensors`` (same shapes as :meth:`tensors`): a captured draft
        half's static copies, which later replays refill with another plan's values."""
        view = copy.copy(self)
        view._tensors = tuple(tensors)
        return view

    def decide(self, path_entropy: torch.Tensor):
        """``path_entropy [B]`` float32 -> ``(bins, depth, budget)``, each ``[B]`` int64."""
        from . import ops
        self.prepare(path_entropy.device)
        return ops.entropy_bin_policy(path_entropy, *self._tensors)

    def describe(self) -> List[dict]:
        lo = [-math.inf] + self.edges
        hi = self.edges + [math.inf]
        return [{"bin": i, "entropy_range": (lo[i], hi[i]), "draft_forwards": self.depth[i],
                 "verified_nodes": self.budget[i] + 1} for i in range(self.num_bins)]

    def to_dict(self) -> dict:
        return {"name": self.name, "speculate": self.speculate, "decide_depth": self.decide_depth,
                "entropy_k": self.entropy_k, "edges": self.edges, "depth": self.depth,
                "budget": self.budget, "expected": self.expected}


class Policy:
    """Maps a batch size to a :class:`Plan`."""

    name = "policy"

    def plan(self, batch_size: int, context: Optional[int] = None) -> Plan:  # pragma: no cover - interface
        """The plan for ``batch_size`` running requests with about ``context`` tokens each."""
        raise NotImplementedError

    def round_plan(self, batch_size: int, context: Optional[int] = None, tokens_left: Optional[int] = None,
                   catchup: Optional[Callable[[], float]] = None, timed: bool = True) -> Plan:
        """The plan of the next round (the fitted policy probes the alternative now and then, and
        weighs a switch to speculation against the draft's catch-up: ``tokens_left``, the
        tokens the call's slowest running request still has to go; ``catchup()``, the tokens per
        request the draft is behind; ``timed``: whether the round's wall time will reach
        ``observe``, False while finished requests' rows ride along in a static batch)."""
        return self.plan(batch_size, context)

    def new_requests(self, batch_size: int) -> None:
        """A call with ``batch_size`` new requests starts (a policy that learns online may forget
        what it measured on earlier prompts; the fixed ones have nothing to forget)."""

    def plain_rounds_ahead(self, batch_size: int) -> int:
        """After :meth:`round_plan` returned a plain plan: how many more rounds at this batch
        size are certain to be plain too (the engine then runs *cold* plain steps, which keep no
        draft catch-up; 0: the next round may speculate)."""
        return 0

    def needs_draft(self, batch_size: int) -> bool:
        """Whether any batch size up to ``batch_size`` speculates (a batch only shrinks)."""
        return any(self.plan(b).speculate for b in range(1, batch_size + 1))

    def max_tree_nodes(self, batch_size: int) -> int:
        """The largest budget (draft nodes, root excluded) any round of a call that starts with
        ``batch_size`` requests may verify: the engine sizes the KV caches with it. A policy
        whose plans change within a call must cover every plan it may return."""
        plans = [self.plan(b) for b in range(1, batch_size + 1)]
        plans += [p.alternative for p in plans if p.alternative is not None]
        return max(p.max_nodes for p in plans)


class Eagle3Policy(Policy):
    """The fixed EAGLE-2 dynamic tree of ``config``: no entropy bins."""

    name = "eagle3"

    def __init__(self, config: SpecConfig) -> None:
        self._plan = Plan("eagle3", decide_depth=config.depth, entropy_k=config.top_k, edges=[],
                          depth=[config.depth], budget=[config.total_tokens - 1], binned=False)

    def plan(self, batch_size: int, context: Optional[int] = None) -> Plan:
        return self._plan


def paper_actions(config: SpecConfig, num_bins: int) -> Tuple[List[int], List[int]]:
    """The paper's per-bin (draft forwards, draft nodes to verify), with our invariant applied:
    a bin that drafts deeper verifies at least one node per candidate layer. (On the CPU tree
    (4, 3, 8) the formula gives bin 0 six layers and four nodes, so the extra layers could never
    be verified.)"""
    extra, nodes = config.bin_actions(num_bins)
    depth = [config.depth + e for e in extra]
    budget = [n - 1 if e == 0 else max(n - 1, config.depth + e + 1) for e, n in zip(extra, nodes)]
    return depth, budget


class PaperPolicy(Policy):
    """HeteroSpec as published: DED and TNP formulas on calibrated bins (``policy="paper"``)."""

    name = "paper"

    def __init__(self, bins: EntropyBins, config: SpecConfig) -> None:
        depth, budget = paper_actions(config, bins.num_bins)
        self.bins = bins
        self._plan = Plan("paper", decide_depth=config.depth, entropy_k=config.resolved_entropy_k,
                          edges=list(bins.edges), depth=depth, budget=budget)

    def plan(self, batch_size: int, context: Optional[int] = None) -> Plan:
        return self._plan


# ---------------------------------------------------------------------------------------------
# Acceptance tables: what calibration measured about the draft
# ---------------------------------------------------------------------------------------------
@dataclass
class BinningOption:
    """Bins of ``H(P*)`` read after ``decide_depth`` forwards with Top-``entropy_k`` entropy, fitted
    on ``label``, and each bin's mean accepted length for every action of the grid."""

    decide_depth: int
    entropy_k: int
    label: str
    edges: List[float]
    counts: List[int]
    accept: List[List[List[float]]]      # [bin][depth index][nodes index] mean accepted drafts

    def mean_accept_by_bin(self, depth_i: int, nodes_i: int) -> List[Optional[float]]:
        return [a[depth_i][nodes_i] if c else None for a, c in zip(self.accept, self.counts)]


@dataclass
class AcceptanceTables:
    """Calibration traces in aggregate: per binning option, per bin, the expected accepted length
    of every (draft forwards, verified nodes) action. Device independent; shipped with the draft
    (``acceptance_tables.json``); fitted by :func:`heterospec.calibrate.calibrate_policy`."""

    top_k: int
    depths: List[int]                    # total draft forwards of the action grid
    nodes: List[int]                     # verified nodes, root included, of the action grid
    options: List[BinningOption]
    provenance: dict = field(default_factory=dict)
    # Observed / predicted P(accepted >= j), j = 1.., of the fitted plans on prompts held out from
    # the calibration (:func:`heterospec.calibrate.measure_held_out`): {"position_scale": [...],
    # "predicted": [...] (the predicted acceptances behind each ratio), "prompts", "source", ...}.
    # None: not measured (the online correction starts from the tables as they are).
    held_out: Optional[dict] = None

    def __post_init__(self) -> None:
        self._survival_cache: dict = {}       # (option, actions) -> survival curves (_survival_matrix)
        if not self.options:
            raise ValueError("AcceptanceTables: no binning options")
        if self.held_out is not None:
            scale = self.held_out.get("position_scale") if isinstance(self.held_out, dict) else None
            if not isinstance(scale, list) or not scale or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 < x <= 4.0 for x in scale):
                raise ValueError("AcceptanceTables: held_out.position_scale must be a non-empty list of "
                                 f"ratios in (0, 4], got {scale!r}")
        if sorted(self.depths) != self.depths or sorted(self.nodes) != self.nodes or self.nodes[0] != 1:
            raise ValueError("AcceptanceTables: depths and nodes must ascend, and nodes must start at 1")
        for o in self.options:
            if len(o.accept) != len(o.edges) + 1 or len(o.counts) != len(o.edges) + 1:
                raise ValueError("AcceptanceTables: one accept table and count per bin")
            for a in o.accept:
                if len(a) != len(self.depths) or any(len(r) != len(self.nodes) for r in a):
                    raise ValueError("AcceptanceTables: accept tables must be [depths][nodes]")

    def to_dict(self) -> dict:
        d = {"top_k": self.top_k, "depths": self.depths, "nodes": self.nodes,
             "options": [o.__dict__ for o in self.options], "provenance": self.provenance}
        if self.held_out is not None:
            d["held_out"] = self.held_out
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "AcceptanceTables":
        return cls(int(d["top_k"]), [int(x) for x in d["depths"]], [int(x) for x in d["nodes"]],
                   [BinningOption(**o) for o in d["options"]], d.get("provenance") or {}, d.get("held_out"))

    def save(self, path: str) -> None:
        from ._io import write_json_atomic
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str) -> "AcceptanceTables":
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"acceptance tables {path} are not valid: {e}") from None

    @classmethod
    def find(cls, draft_dir: Optional[str], top_k: Optional[int] = None) -> Optional["AcceptanceTables"]:
        """The tables next to the draft: for tree ``top_k`` ``acceptance_tables_k<top_k>.json`` when
        present, else ``acceptance_tables.json`` (of whatever top_k: the caller compares)."""
        from ._io import find_tree_file

        path = find_tree_file(draft_dir, TABLES_FILENAME, f"k{top_k}" if top_k else None)
        return cls.load(path) if path else None

    @staticmethod
    def path_to_write(out_dir: str, top_k: int) -> str:
        """Where calibration tables for tree ``top_k`` are saved (see ``_io.tree_file_to_write``)."""
        from ._io import tree_file_to_write

        return tree_file_to_write(out_dir, TABLES_FILENAME, f"k{top_k}", lambda d: int(d.get("top_k", -1)) == top_k)


# ---------------------------------------------------------------------------------------------
# The fitted policy
# ---------------------------------------------------------------------------------------------
def _expected_fn_of_max(values: Sequence[int], probs: Sequence[float], n: int, fn) -> float:
    """E[fn(max of n i.i.d. draws)]."""
    pairs = sorted(zip(values, probs))
    total, cdf_prev, acc = 0.0, 0.0, 0.0
    for v, p in pairs:
        acc += p
        total += fn(v) * (acc ** n - cdf_prev ** n)
        cdf_prev = acc
    return total


def plan_cost(cost, batch_size: int, decide_depth: int, probs: Sequence[float], depth: Sequence[int],
              nodes: Sequence[int], accept: Sequence[float], context: int, ragged: bool,
              static: bool = False) -> dict:
    """Expected tokens, milliseconds and tokens/s of one round of ``batch_size`` requests whose
    bins are i.i.d. with ``probs``; bin ``i`` drafts ``depth[i]`` forwards, verifies ``nodes[i]``
    nodes (root included) and accepts ``accept[i]`` drafts on average.

    The draft loop runs until the deepest request of the batch is done, and (unless the verify
    forward is ragged) every request is padded to the largest tree of the batch. A request alone
    (``batch_size`` 1) is neither: its round costs its own bin's verify, in expectation.

    ``static``: capture-ready rounds (CUDA graphs, ``Engine.static_rounds``) have one shape per
    plan: every round drafts the deepest bin's forwards and verifies the largest budget, whatever
    its requests' bins (a shallower bin's layers are masked, not skipped)."""
    B = batch_size
    tokens = B * sum(p * (a + 1.0) for p, a in zip(probs, accept))
    mean_new = tokens / B
    if static:
        live = [i for i, p in enumerate(probs) if p > 0] or list(range(len(probs)))
        steps = float(max(depth[i] for i in live))
        draft = cost.draft_ms(B, steps, extend_tokens=mean_new)
        verify = cost.verify_ms(B, max(nodes[i] for i in live), context)
        ms = draft + verify
        return {"tokens": tokens, "ms": ms, "tokens_per_s": 1e3 * tokens / ms, "draft_ms": draft, "verify_ms": verify}
    steps = _expected_fn_of_max(depth, probs, B, float)
    draft = cost.draft_ms(B, steps, extend_tokens=mean_new)
    if ragged and B > 1:   # the linear layers see the batch's real tree tokens: the mean N per request
        verify = cost.verify_ms(B, sum(p * n for p, n in zip(probs, nodes)), context)
    else:        # every request padded to the largest tree of the batch
        verify = _expected_fn_of_max(nodes, probs, B, lambda n: cost.verify_ms(B, n, context))
    ms = draft + verify
    return {"tokens": tokens, "ms": ms, "tokens_per_s": 1e3 * tokens / ms, "draft_ms": draft, "verify_ms": verify}


class _MemoCost:
    """``cost`` with its answers remembered (the search asks the same few hundred questions in
    every fit; a cost model interpolates in Python on every call): for one fit, or in a
    :class:`FittedPolicy` until its next :meth:`~FittedPolicy.refit`. ``draft_ms`` is
    taken as affine in ``extend_tokens`` from 1 up, as every cost model here is (the draft's
    extend forward is linear in the tokens it extends over): two answers per (B, forwards)."""

    def __init__(self, cost) -> None:
        self.cost, self._memo = cost, {}

    def _ask(self, name, *args):
        key = (name,) + args
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = getattr(self.cost, name)(*args)
        return v

    def verify_ms(self, B, nodes, context=256):
        return self._ask("verify_ms", B, nodes, context)

    def draft_ms(self, B, forwards, extend_tokens=1.0):
        one = self._ask("draft_ms", B, forwards, 1.0)
        if extend_tokens == 1.0:
            return one
        return one + (extend_tokens - 1.0) * (self._ask("draft_ms", B, forwards, 2.0) - one)

    def plain_ms(self, B, context=256):
        return self._ask("plain_ms", B, context)


def _option_actions(tables: "AcceptanceTables", opt: "BinningOption", max_nodes: Optional[int]):
    """Candidate actions ``(forwards, nodes, depth index, nodes index)`` of one binning option."""
    out = []
    for di, d in enumerate(tables.depths):
        if d < opt.decide_depth:
            continue
        for ni, n in enumerate(tables.nodes):
            if max_nodes is not None and n - 1 > max_nodes:
                continue
            if d > opt.decide_depth and n - 1 < d + 1:      # the invariant
                continue
            out.append((d, n, di, ni))
    return out


def action_survival(tables: "AcceptanceTables", opt: "BinningOption", bin_i: int, depth_i: int,
                    nodes_i: int) -> List[float]:
    """``P(accepted >= j)`` for ``j = 1..depth + 1`` of one action of one bin, from the tables
    (``d`` forwards draft ``d + 1`` candidate layers: the first comes with the forward that
    extends the accepted tokens): the mean accepted length of the action truncated to ``j - 1``
    forwards (same verified nodes) minus that truncated to ``j - 2``. Exact for chains (a
    shorter chain is a prefix of the longer one); for trees the truncated tree spends the same
    budget on fewer layers, a close approximation. A depth missing from the grid puts its
    increment on the next depth that is there. The sum is the action's mean accepted length."""
    if not opt.counts[bin_i] or tables.nodes[nodes_i] <= 1:
        return []
    row = opt.accept[bin_i]
    out, prev = [], 0.0
    for k in range(depth_i + 1):
        pos = tables.depths[k] + 1
        out.extend([0.0] * (pos - 1 - len(out)))
        a = row[k][nodes_i]
        out.append(max(0.0, a - prev))
        prev = max(prev, a)
    return out


def corrected_accept(survival: Sequence[float], position_scale: Sequence[float]) -> float:
    """Mean accepted drafts of an action whose tables' survival is ``survival`` once every
    position ``j`` is scaled by ``position_scale[j - 1]`` (observed / predicted on this workload;
    positions past the end of the list take its last entry, an empty list scales nothing). The
    corrected survival is kept non-increasing: a later draft is accepted only after the earlier."""
    total, prev = 0.0, 1.0
    for j, sj in enumerate(survival):
        r = position_scale[min(j, len(position_scale) - 1)] if position_scale else 1.0
        prev = min(prev, sj * r)
        total += prev
    return total


def _survival_matrix(tables: "AcceptanceTables", opt: "BinningOption", actions) -> tuple:
    """Every (bin, action) survival curve of one option: the lists (:func:`action_survival`) and
    the same as an array ``[bins, actions, positions]``, zero-padded. Cached on ``tables``."""
    key = (id(opt), tuple((a[2], a[3]) for a in actions))
    hit = tables._survival_cache.get(key)
    if hit is None:
        lists = [[action_survival(tables, opt, i, a[2], a[3]) for a in actions] for i in range(len(opt.counts))]
        width = max([len(sv) for row in lists for sv in row] + [1])
        arr = np.zeros((len(lists), len(actions), width))
        for i, row in enumerate(lists):
            for c, sv in enumerate(row):
                arr[i, c, :len(sv)] = sv
        hit = tables._survival_cache[key] = (lists, arr)
    return hit


def _corrected_accept_matrix(survival: np.ndarray, position_scale: Sequence[float],
                             bin_scale: Optional[Sequence[float]] = None) -> np.ndarray:
    """:func:`corrected_accept` of every curve of ``survival`` (``[..., positions]``) at once;
    ``bin_scale`` (``survival`` ``[bins, actions, positions]``): a further factor per bin."""
    npos = survival.shape[-1]
    r = np.array([position_scale[min(j, len(position_scale) - 1)] for j in range(npos)]
                 if position_scale else np.ones(npos))
    if bin_scale is not None:
        r = r[None, None, :] * np.asarray(bin_scale, dtype=float)[:, None, None]
    return np.minimum.accumulate(np.minimum(survival * r, 1.0), axis=-1).sum(axis=-1)


def _expected_of_max_rows(values: np.ndarray, probs: np.ndarray, n: int, fn: np.ndarray) -> np.ndarray:
    """Per row of ``values`` (``[rows, bins]`` integers in ``[0, len(fn))``, bin ``i`` drawn with
    ``probs[i]``): E[fn[max of ``n`` i.i.d. draws]], from P(max <= t) = P(one draw <= t) ** n."""
    rows, grid = values.shape[0], len(fn)
    idx = values + grid * np.arange(rows)[:, None]
    mass = np.bincount(idx.ravel(), weights=np.broadcast_to(probs, values.shape).ravel(),
                       minlength=rows * grid).reshape(rows, grid)
    cdf_n = np.cumsum(mass, axis=1) ** n
    cdf_n[:, 1:] -= cdf_n[:, :-1].copy()
    return cdf_n @ fn


RAGGED_STEP = 8


def _fit_option(tables, opt, cost, B: int, context: int, ragged: bool, max_nodes,
                position_scale: Sequence[float] = (), probs: Optional[Sequence[float]] = None,
                quick: bool = False, bin_scale: Optional[Sequence[float]] = None, static: bool = False):
    """Best per-bin actions of one binning option at batch ``B``: ``(actions, evaluation)``.
    ``position_scale`` corrects the tables' acceptance per draft position
    (:func:`corrected_accept`), ``bin_scale`` further per bin; ``probs`` replaces the calibration
    frequencies of the bins.
    ``quick`` (batch > 1): no ascent, only ``(None, {"tokens_per_s": ...})`` of the better of its
    two starts (what :func:`fit_plan` short-lists options by). ``static``: rounds of one shape
    per plan (:func:`plan_cost`), at every batch size: the search prices the deepest bin's
    forwards and the largest budget, and so lifts every bin to them (the same time, more accepted).

    The search runs on arrays (a fit happens while requests wait: it must cost far less than a
    target step): every candidate action of a bin is priced at once, as :func:`plan_cost` would
    price it. ``cost.draft_ms`` is read at whole forwards and taken as linear between them and
    affine in ``extend_tokens``, as every cost model here is; a ragged verify at a fractional
    node count is interpolated between multiples of ``1 / RAGGED_STEP`` (the plan's evaluation
    is then exact: :func:`plan_cost`)."""
    total = sum(opt.counts)
    actions = _option_actions(tables, opt, max_nodes)
    if total == 0 or not actions:
        return None, None
    p = np.array(list(probs) if probs is not None else [c / total for c in opt.counts], dtype=float)
    nb = len(p)
    surv, surv_arr = _survival_matrix(tables, opt, actions)
    if bin_scale is not None and len(bin_scale) != nb:
        bin_scale = None
    acc = _corrected_accept_matrix(surv_arr, position_scale, bin_scale)    # [bins, actions]
    fwd = np.array([a[0] for a in actions], dtype=float)
    node_i = np.array([a[3] for a in actions])
    nodes = np.array([a[1] for a in actions], dtype=float)
    fi = fwd.astype(int)
    steps_grid = np.arange(int(fwd.max()) + 1, dtype=float)
    bins_ix = np.arange(nb)

    # Ragged: the verify cost of the batch's mean node count, read every 1/RAGGED_STEP node.
    ragged_grid = np.arange(1.0, float(nodes.max()) + 1e-9, 1.0 / RAGGED_STEP) if ragged else None

    def device(batch):
        """The cost model at ``batch`` as arrays: draft at whole forwards (1 and 2 tokens
        extended), verify per node count of the tables' grid, and (ragged, batch > 1) per
        node count of ``ragged_grid``."""
        d1 = np.array([cost.draft_ms(batch, k, 1.0) for k in steps_grid])
        d2 = np.array([cost.draft_ms(batch, k, 2.0) for k in steps_grid])
        per_node = np.array([cost.verify_ms(batch, float(n), context) for n in tables.nodes])
        per_mean = (np.array([cost.verify_ms(batch, float(n), context) for n in ragged_grid])
                    if ragged and batch > 1 else None)
        return d1, d2 - d1, per_node, per_mean

    live = p > 0

    def rates(choices, batch, dev):
        """Expected tokens/s of each row of ``choices`` (``[rows, bins]`` action indices)."""
        d1, slope, per_node, per_mean = dev
        a = acc[bins_ix, choices]
        mean_new = (a + 1.0) @ p
        if static:     # one shape per plan: the deepest bin's forwards, the largest budget
            steps = np.where(live, fwd[choices], 0.0).max(axis=-1)
            draft = np.interp(steps, steps_grid, d1) + (mean_new - 1.0) * np.interp(steps, steps_grid, slope)
            return 1e3 * batch * mean_new / (draft + per_node[np.where(live, node_i[choices], 0).max(axis=-1)])
        # E[max] of one draw is the mean: batch 1 needs no sort
        steps = fwd[choices] @ p if batch == 1 else _expected_of_max_rows(fi[choices], p, batch, steps_grid)
        draft = np.interp(steps, steps_grid, d1) + (mean_new - 1.0) * np.interp(steps, steps_grid, slope)
        if per_mean is not None:   # the linear layers see the batch's real tree tokens: the mean N per request
            ver = np.interp(nodes[choices] @ p, ragged_grid, per_mean)
        elif batch == 1:           # alone: the request's own bin's verify
            ver = per_node[node_i[choices]] @ p
        else:        # every request padded to the largest tree of the batch
            ver = _expected_of_max_rows(node_i[choices], p, batch, per_node)
        return 1e3 * batch * mean_new / (draft + ver)

    # Per bin, only the actions no other action dominates (as many accepted drafts or more with
    # no more forwards and no more nodes): the round's tokens rise with the accepted drafts, its
    # time with forwards (the batch's deepest) and nodes, so a dominated action is never needed.
    no_more = (fwd[None, :] <= fwd[:, None]) & (nodes[None, :] <= nodes[:, None])     # [c, c']
    np.fill_diagonal(no_more, False)
    keep = ~(no_more[None] & (acc[:, None, :] >= acc[:, :, None])).any(axis=2)        # [bins, actions]

    # Batch 1 separates by bin (Dinkelbach): maximise sum_i p_i (a_i + 1 - lam * ms_i), then
    # lam = tokens / ms, until lam settles. Exact for batch 1; the start for larger batches.
    # (Each bin's ms is its own verify, read at the tables' node grid, ragged or not.)
    dev1 = device(1)
    unit = dev1[0][fi] + acc * dev1[1][fi] + dev1[2][node_i]                  # [bins, actions] ms
    choice, lam = np.zeros(nb, dtype=int), 0.0
    for _ in range(20):
        choice = np.argmax(np.where(keep, acc + 1.0 - lam * unit, -np.inf), axis=1)   # ties: the first
        new_lam = float(rates(choice[None], 1, dev1)[0]) / 1e3
        if abs(new_lam - lam) <= 1e-12 * max(1.0, lam):
            break
        lam = new_lam
    if B > 1 or static:
        # Steepest ascent on the exact batch objective, one bin's action at a time, from two
        # starts: the batch-1 optimum, and the best action taken by every bin alike. In a batch
        # the deepest request sets the draft's forwards and (padded) the largest tree the verify
        # width, so lowering one bin alone rarely pays while lowering all of them does: from the
        # batch-1 start alone the ascent stops on such a ridge.
        devB = device(B)
        uniform = np.repeat(np.arange(len(actions))[:, None], nb, axis=1)
        uniform_rates = rates(uniform, B, devB)
        if quick:
            return None, {"tokens_per_s": max(float(rates(choice[None], B, devB)[0]), float(uniform_rates.max()))}
        rows_bin, rows_act = np.nonzero(keep)          # trial row k: bin rows_bin[k] takes rows_act[k]
        trials = np.empty((len(rows_bin), nb), dtype=int)

        def ascend(start):
            start, best = start.copy(), float(rates(start[None], B, devB)[0])
            for _ in range(3 * nb):
                trials[:] = start
                trials[np.arange(len(rows_bin)), rows_bin] = rows_act
                r = rates(trials, B, devB)
                k = int(np.argmax(r))
                if not r[k] > best * (1 + 1e-9):
                    break
                start, best = trials[k].copy(), float(r[k])
            return best, start

        ends = [ascend(choice), ascend(uniform[int(np.argmax(uniform_rates))])]
        choice = ends[1][1] if ends[1][0] > ends[0][0] * (1 + 1e-9) else ends[0][1]
    chosen = [int(c) for c in choice]
    ev = plan_cost(cost, B, opt.decide_depth, list(p), [actions[c][0] for c in chosen],
                   [actions[c][1] for c in chosen], [float(acc[i, c]) for i, c in enumerate(chosen)],
                   context, ragged, static)
    return [actions[c] + (float(acc[i, c]), surv[i][c]) for i, c in enumerate(chosen)], ev


FIT_CACHE = 512     # option fits fit_plan's ``fits`` keeps before it starts again


def fit_plan(tables: AcceptanceTables, cost, batch_size: int, context: int = 256, ragged: bool = False,
             max_nodes: Optional[int] = None, margin: float = PLAIN_MARGIN,
             position_scale: Sequence[float] = (), time_scale: float = 1.0, plain_scale: float = 1.0,
             bin_freq: Optional[Dict[int, Sequence[float]]] = None, shortlist: Optional[dict] = None,
             bin_scale: Optional[Dict[int, Sequence[float]]] = None, static: bool = False,
             options: Optional[Sequence[int]] = None, scores: Optional[Dict[int, float]] = None,
             fits: Optional[dict] = None) -> Plan:
    """The plan that maximises expected tokens/s at ``batch_size`` under ``cost``.

    Every binning option of ``tables`` (where ``H(P*)`` is read, its K, the CART label) gets its
    best per-bin actions (:func:`_fit_option`); candidates per bin are every (forwards >=
    decide_depth, nodes) of the grid that keeps the invariant, "verify the root only" included.
    The best option is compared with plain decoding (no draft at all), which wins unless
    speculation is predicted ``margin`` times faster. ``position_scale``: per draft position, the
    ratio of observed to predicted acceptance on this workload; ``time_scale``: of observed to predicted
    speculative round time on this device, ``plain_scale`` the same for plain steps
    (:meth:`FittedPolicy.observe`); ``bin_freq``: per option index, the bin frequencies of this
    workload (instead of the calibration ones); ``bin_scale``: per option index, a factor per bin
    on the position-corrected acceptance (observed / predicted, per bin). The returned plan carries the best plan of the
    other kind as ``alternative`` (None when no speculative action exists, or the best verifies the
    root only in every bin: a plain step plus draft forwards). At batch > 1 the
    (costlier) batch search runs on a shortlist: the 3 options best at batch 1 and the 3 whose
    search starts (the batch-1 optimum, the best action for all bins alike) are fastest at this
    batch size. ``shortlist``: a dict the caller keeps to reuse them (valid while ``cost`` and the
    other arguments but ``batch_size`` and the time scales stay the same). ``options``: fit only
    these binning options (indices into ``tables.options``; default all); ``scores``: a dict
    filled with the expected tokens/s (before ``time_scale``) of every option fully fitted.
    ``fits``: a dict the caller keeps to reuse each option's fitted actions while ``cost`` stays
    the same: the time scales only scale an option's evaluation, so a refit that only they moved
    (a plain bucket's plain steps move ``plain_scale``) re-decides without a search."""
    B = batch_size
    cost = cost if isinstance(cost, _MemoCost) else _MemoCost(cost)
    plain_ms = cost.plain_ms(B, context) * plain_scale
    plain = {"tokens": float(B), "ms": plain_ms, "tokens_per_s": 1e3 * B / plain_ms}
    bin_freq = bin_freq or {}
    bin_scale = bin_scale or {}
    options = list(range(len(tables.options))) if options is None else \
        sorted({int(i) for i in options if 0 <= int(i) < len(tables.options)})

    def fit(i, batch, quick=False):
        key = None if fits is None or quick else (
            i, batch, context, ragged, static, max_nodes, tuple(position_scale),
            None if bin_freq.get(i) is None else tuple(bin_freq[i]),
            None if bin_scale.get(i) is None else tuple(bin_scale[i]))
        if key is not None and key in fits:
            return fits[key]
        out = _fit_option(tables, tables.options[i], cost, batch, context, ragged, max_nodes,
                          position_scale, bin_freq.get(i), quick, bin_scale.get(i), static)
        if key is not None:
            if len(fits) >= FIT_CACHE:
                fits.clear()
            fits[key] = out
        return out

    def best3(batch, quick=False):
        scored = [(e["tokens_per_s"], i) for i, e in ((i, fit(i, batch, quick)[1]) for i in options) if e is not None]
        return [i for _, i in sorted(scored, key=lambda t: (-t[0], t[1]))[:3]]

    if B > 1:   # the batch search is costlier: only the options best alone or starting best here
        shortlist = {} if shortlist is None else shortlist
        key = (tuple(options), context, ragged, static, max_nodes, tuple(position_scale),
               tuple(sorted(bin_freq.items())), tuple(sorted((i, tuple(v)) for i, v in bin_scale.items())))
        if key not in shortlist:
            shortlist[key] = best3(1)
        if key + (B,) not in shortlist:
            shortlist[key + (B,)] = sorted(set(shortlist[key]) | set(best3(B, quick=True)))
        options = shortlist[key + (B,)]
    best, best_eval = None, None
    for i in options:
        acts, ev = fit(i, B)
        if ev is not None and scores is not None:
            scores[i] = float(ev["tokens_per_s"])
        if ev is not None:     # (a copy: the plan's expected values are its own, not the kept fit's)
            ev = dict(ev, ms=ev["ms"] * time_scale, tokens_per_s=ev["tokens_per_s"] / time_scale)
        if ev is not None and (best_eval is None or ev["tokens_per_s"] > best_eval["tokens_per_s"]):
            best, best_eval = (i, acts), ev
    scales = {"position_scale": list(position_scale), "time_scale": time_scale, "plain_scale": plain_scale,
              "context": context}
    plain_plan = Plan("fitted", speculate=False, decide_depth=0, entropy_k=tables.top_k, edges=[], depth=[0],
                      budget=[0], binned=False,
                      expected={"plain": plain, "speculative": best_eval, "batch_size": B, **scales})
    if best is None or all(a[1] <= 1 for a in best[1]):
        # (a plan that verifies the root only in every bin is a plain step plus the draft's
        # forwards: never faster, and not worth probing)
        return plain_plan
    opt_i, acts = best
    opt = tables.options[opt_i]
    spec_plan = Plan("fitted", decide_depth=opt.decide_depth, entropy_k=opt.entropy_k, edges=list(opt.edges),
                     depth=[a[0] for a in acts], budget=[a[1] - 1 for a in acts],
                     expected={"plain": plain, "speculative": best_eval, "batch_size": B, "label": opt.label,
                               "option": opt_i, "bin_freq": list(bin_freq[opt_i]) if opt_i in bin_freq else None,
                               "bin_scale": list(bin_scale[opt_i]) if opt_i in bin_scale else None,
                               **scales},
                     predicted_accept=[a[4] for a in acts], survival=[list(a[5]) for a in acts])
    if best_eval["tokens_per_s"] < margin * plain["tokens_per_s"]:
        plain_plan.alternative = spec_plan
        return plain_plan
    spec_plan.alternative = plain_plan
    return spec_plan


class FittedPolicy(Policy):
    """Per-bin actions fitted to measured acceptance and measured cost (``policy="fitted"``).

    Plans are fitted lazily and cached, per batch-size bucket (1, 2, 3, 4, 6, 8, 12, 16, 24, ...:
    a batch of 10 uses the plan fitted for 8) and context bucket (powers of two from 256)."""

    name = "fitted"

    def __init__(self, tables: AcceptanceTables, cost, config: SpecConfig, context: int = 256,
                 ragged: bool = False, state_path: Optional[str] = None, max_nodes: Optional[int] = None,
                 static: bool = False) -> None:
        if tables.top_k != config.top_k:
            raise ValueError(f"acceptance tables were measured with tree top_k {tables.top_k}, "
                             f"the engine drafts with top_k {config.top_k}")
        self.tables, self.cost, self.config = tables, cost, config
        self.context, self.ragged, self.max_nodes = context, ragged, max_nodes
        self.static = static     # capture-ready rounds: one shape per plan (plan_cost)
        self._plans: Dict[Tuple[int, int, float], Plan] = {}
        # Online correction: per draft position j, how often the requests of this workload
        # accepted >= j drafts vs. how often the tables predicted it for the same bins and actions;
        # and speculative round time observed vs. what the cost model predicted, per batch bucket
        # (exponentially forgotten sums).
        npos = max(tables.depths) + 1
        self._pos_obs = [0.0] * npos
        self._pos_pred = [0.0] * npos
        self._time: Dict[int, List[float]] = {}
        self._plain: Dict[int, List[float]] = {}      # the same for plain steps
        self._rounds: Dict[int, int] = {}             # rounds planned per bucket (probe schedule)
        # The scales in use move only by HYSTERESIS or more, so plans are refitted rarely.
        self._pos_used = [1.0] * npos
        # Bins visited by this workload, per binning option in use (forgotten counts), and the
        # frequencies in use (moved by FREQ_HYSTERESIS or more).
        self._bin_obs: Dict[int, List[float]] = {}
        self._freq_used: Dict[int, Tuple[float, ...]] = {}
        # Per binning option, bin and draft position: how often a request accepted it vs. the
        # tables' prediction (forgotten sums, as the position scale's), and the factors in use
        # (see bin_scale).
        self._bin_acc: Dict[int, List[List[float]]] = {}
        self._bin_scale_used: Dict[int, Tuple[float, ...]] = {}
        # Derived values per evidence version (observe() of a speculative round, load_state): see _unchanged
        self._evidence = 0
        self._derived: Dict[str, tuple] = {}
        # Binning options whose counts / sums moved since bin_frequencies / bin_scale last ran
        # (None: every option): a round observes one option, and recomputing all of them (8
        # options of 8 bins, 7 positions, after a few refits) cost ~100 us a speculative round.
        self._freq_dirty: Optional[set] = None
        self._scale_dirty: Optional[set] = None
        self._scale_pos: Optional[Tuple[float, ...]] = None   # the position scale bin_scale last used
        # Every change of what plan() depends on (observe, new_requests, the probe schedule's
        # resets, refit, load_state) moves this version; plan() is memoised per version (its plain
        # plans across a few plain steps), so the engine's lookup gate and the round's plan ask
        # for it once per round.
        self._version = 0
        self._plan_memo: Tuple[Tuple[int, int], Dict[Tuple[int, int], Plan]] = ((-1, 0), {})
        # Per bucket: speculative tokens/request, seconds, rounds; plain the same; the speculative
        # rounds' squared tokens/request (the guard; see GUARD_Z).
        self._realized: Dict[int, List[float]] = {}
        self._observed_rounds: Dict[int, int] = {}    # rounds observed per bucket (refit gap)
        self._since_probe: Dict[int, int] = {}        # plain rounds since the last speculative probe
        self._backoff: Dict[int, int] = {}            # log2 of the speculative probe interval / PROBE_EVERY
        # last PROBE_BURST speculative rounds: (tokens, seconds, the draft's catch-up seconds taken off them)
        self._recent_spec: Dict[int, List[Tuple[float, float, float]]] = {}
        self._burst: Dict[int, int] = {}              # speculative rounds left in a plain bucket's probe
        self._probe_second: Dict[int, bool] = {}      # a speculating bucket's plain probe has its second step next
        self._plain_ahead: Dict[int, int] = {}        # plain rounds certain after the last one planned
        # per plain bucket: (plan, context bucket, _stamp(), probe spacing) of its last full plan (round_plan)
        self._stretch: Dict[int, Tuple[Plan, int, Tuple[int, int], Optional[int]]] = {}
        self._plain_seen = 0                          # plain steps observed (see _fresh)
        self._last_fit: Dict[int, Tuple[int, Plan]] = {}
        self._shortlist: dict = {}                    # fit_plan's batch-1 option shortlist
        # per bucket: fits since its last full fit, and the options that fitted best in it
        self._option_rank: Dict[int, Tuple[int, Optional[List[int]]]] = {}
        self._memo = _MemoCost(cost)                  # the cost model's answers, until a refit
        self._option_fits: dict = {}                  # fit_plan's option fits, until a refit
        self._fit_s = 0.0                             # seconds spent fitting (the refit budget)
        self._fits = 0                                # fits made (bench/policy_fit_ab.py)
        self._round_s = 0.0                           # seconds of the rounds observed
        self._time_used: Dict[int, float] = {}
        self._plain_used: Dict[int, float] = {}
        self._start_from_held_out()
        # Where the online state is kept between processes (None: not kept).
        self.state_path = state_path
        if state_path is not None and os.path.exists(state_path):
            try:
                with open(state_path) as f:
                    self.load_state(json.load(f))
            except (OSError, ValueError):
                pass                    # unreadable: start from the tables

    @staticmethod
    @functools.lru_cache(maxsize=4096)        # called several times per step
    def bucket(batch_size: int) -> int:
        b = 1
        for nxt in _buckets():
            if nxt > batch_size:
                return b
            b = nxt
        return b  # pragma: no cover - _buckets is unbounded

    @staticmethod
    def context_bucket(context: int) -> int:
        """The context length plans are fitted for: powers of two from 256."""
        return 1 << max(8, int(max(context, 1) - 1).bit_length())

    def plan(self, batch_size: int, context: Optional[int] = None) -> Plan:
        key = (self.bucket(batch_size), self.context if context is None else self.context_bucket(context))
        stamp, memo = self._plan_memo
        # Plain plans stand over at most PLAIN_REPLAN plain steps (as round_plan's plain stretch):
        # each moves the plain correction and the guard's plain rate by a few per cent of a step,
        # and a call that never drafts asks for its plan every step (~40 us a step of Python at
        # batch 1-8 on the 2-core box, bench/RESULTS.md, sixty-eighth session).
        if stamp[0] != self._version and not (self._fresh(stamp) and not any(p.speculate for p in memo.values())):
            memo = {}
            self._plan_memo = (self._stamp(), memo)
        if key not in memo:
            plan = self.fitted_plan(batch_size, context)
            if plan.speculate and self.realized_loses(key[0]):
                plan = plan.alternative       # the guard: speculation measured slower than plain steps
            memo[key] = plan
        return memo[key]

    # When a bucket whose corrections moved is refitted: as soon as fitting has taken at most
    # FIT_SHARE of the timed rounds' time (a fit costs a few ms; the first corrections of a
    # workload move the most and are taken up after a round or two, not after many rounds of a
    # plan they contradict), and at the latest after REFIT_GAP of its rounds (callers that time
    # nothing). At least one observed round of the bucket between two of its fits.
    FIT_SHARE = 0.05
    REFIT_GAP = 16
    # A fit searches every binning option of the tables (16 for the shipped draft: where H(P*)
    # is read, its K, the CART label), a few ms at batch 1, and the corrections move it every
    # few rounds. Between full fits a bucket refits only the SHORTLIST options that fitted best
    # in its last full fit; every FULL_EVERY-th fit of a bucket searches them all again, so a
    # workload that moves the best option elsewhere is followed within that many fits.
    SHORTLIST = 3
    FULL_EVERY = 8

    def fitted_plan(self, batch_size: int, context: Optional[int] = None) -> Plan:
        """The plan the model fits (with the online corrections), before the guard. A bucket
        keeps its last plan while the fit budget (``FIT_SHARE``, ``REFIT_GAP``) says wait."""
        b = self.bucket(batch_size)
        c = self.context if context is None else self.context_bucket(context)
        s, t, q = self.position_scale(), self.time_scale(b), self.plain_scale(b)
        fk, gk = self._as_key("bin_frequencies"), self._as_key("bin_scale")
        key = (b, c, s, t, q, fk, gk)
        last = self._last_fit.get(b)
        if key not in self._plans and last is not None:
            since = self._observed_rounds.get(b, 0) - last[0]
            if since < 1 or (since < self.REFIT_GAP and self._fit_s > self.FIT_SHARE * self._round_s):
                return last[1]
        if key not in self._plans:
            t0 = time.perf_counter()
            since_full, best = self._option_rank.get(b, (self.FULL_EVERY, None))
            full = best is None or since_full + 1 >= self.FULL_EVERY
            scores: Dict[int, float] = {}
            plan = fit_plan(self.tables, self._memo, b, c, self.ragged, max_nodes=self.max_nodes,
                            position_scale=s, time_scale=t, plain_scale=q, bin_freq=dict(fk), shortlist=self._shortlist,
                            bin_scale=dict(gk), static=self.static, options=None if full else best, scores=scores,
                            fits=self._option_fits)
            if full and scores:
                best = sorted(scores, key=lambda i: (-scores[i], i))[:self.SHORTLIST]
            self._option_rank[b] = (0 if full else since_full + 1, best)
            self._fit_s += time.perf_counter() - t0
            self._fits += 1
            if plan.speculate:            # the plain plan the guard falls back to probes this one
                plan.alternative.alternative = plan
            self._plans[key] = plan
        self._last_fit[b] = (self._observed_rounds.get(b, 0), self._plans[key])
        return self._plans[key]

    # The guard (per batch bucket): what speculative rounds and plain steps actually delivered,
    # tokens per request per second, forgotten faster than the corrections (recent rounds count).
    REALIZED_FORGET = 0.97
    # forgotten counts of speculative rounds and plain steps before the guard may act (5 and 3)
    MIN_REALIZED = (4.5, 2.5)

    # The guard's prior: the model's current prediction for the bucket's speculative plan (with
    # the online corrections) counts as GUARD_PRIOR_ROUNDS / B speculative rounds at batch B.
    # Without it a handful of unlucky rounds decided alone: five rounds that accept nothing
    # happen 8 % of the time at an acceptance of 0.4, and a short warm-up call that met them
    # turned speculation off for the next PROBE_EVERY rounds (batch sweeps: a fresh process's
    # first call at batch 1 decoded plainly where speculation pays). The noise it guards
    # against is a round's accepted length, whose mean over B requests varies as 1 / B; a prior
    # of the same weight at every batch size kept an optimistic model speculating for many more
    # losing rounds at batch 4-16 (bench/RESULTS.md, the guard's prior).
    GUARD_PRIOR_ROUNDS = 3.0

    def _speculative_prior(self, bucket: int) -> Optional[Tuple[float, float, float]]:
        """(tokens per request, seconds, weight in rounds) of one round of the bucket's last
        fitted speculative plan as the model predicts it, or None before a fit."""
        last = self._last_fit.get(bucket)
        if last is None:
            return None
        plan = last[1] if last[1].speculate else last[1].alternative
        exp = (plan.expected or {}) if plan is not None and plan.speculate else {}
        spec, B = exp.get("speculative") or {}, exp.get("batch_size")
        if not B or not spec.get("ms") or spec.get("tokens") is None:
            return None
        seconds = 1e-3 * float(spec["ms"]) * self._context_norm(int(B), exp.get("context"))
        return float(spec["tokens"]) / float(B), seconds, self.GUARD_PRIOR_ROUNDS / float(B)

    # The guard compares rounds measured at different context lengths: its plain steps are often
    # another request's (a speculating bucket probes few), and a plain step at 1,000 tokens of
    # context costs more than at 100. Unscaled, a batch-1 call after a long-context set (the
    # benchmark's cnndm) judged its own speculation against plain steps 1.4x its own, and kept
    # speculating while it lost 20 % (bench/RESULTS.md, sixty-second session). So every time the
    # guard keeps is scaled to GUARD_CONTEXT by the cost model's plain steps: a round at context c
    # counts plain_ms(GUARD_CONTEXT) / plain_ms(c) of its seconds.
    GUARD_CONTEXT = 256

    def _context_norm(self, batch_size: int, context: Optional[int]) -> float:
        """The factor that scales a round's seconds at ``context`` to ``GUARD_CONTEXT`` (1 where
        the context is unknown). Asked per 16 tokens of context, so the cost model's answers,
        kept by ``_memo`` until a refit, stay few (a step moves the context by one)."""
        if context is None:
            return 1.0
        here = self._memo.plain_ms(batch_size, (int(context) >> 4) << 4)
        ref = self._memo.plain_ms(batch_size, self.GUARD_CONTEXT)
        return ref / here if here > 0 and ref > 0 else 1.0

    def realized(self, bucket: int) -> Optional[Tuple[float, float]]:
        """``(speculative, plain)`` tokens per request per second measured at this bucket, or
        None until both were measured ``MIN_REALIZED`` times. The speculative rate includes
        ``GUARD_PRIOR_ROUNDS / B`` rounds of the model's prediction."""
        v = self._verdict(bucket)
        return None if v is None else v[:2]

    # The guard holds a bucket plain only where speculation's measured rate is more than GUARD_Z
    # standard errors (from its rounds' spread of tokens per request) below the plain steps':
    # a verdict re-judged on a new call's first round or two (CALL_CARRY) turned bfloat16 batch
    # 2 plain after one ordinary round (an accepted length of 0-1 is common at this draft's
    # acceptance) in 6 of 8 calls whose speculation, run throughout, won 4-8 %
    # (bench/RESULTS.md, fifty-second session). A loss well beyond a round's noise still turns
    # it at once.
    GUARD_Z = 1.0

    def _verdict(self, bucket: int) -> Optional[Tuple[float, float, float]]:
        """``(speculative, plain, standard error of the speculative)`` rates of :meth:`realized`."""
        st = self._realized.get(bucket)
        if st is None:
            return None
        st_tok, st_s, st_n, pl_tok, pl_s, pl_n, st_sq = st
        if st_n < self.MIN_REALIZED[0] or pl_n < self.MIN_REALIZED[1] or st_s <= 0 or pl_s <= 0:
            return None
        mean = st_tok / st_n
        spread = math.sqrt(max(st_sq / st_n - mean * mean, 0.0))      # of a round's tokens per request
        prior = self._speculative_prior(bucket)
        n = st_n
        if prior is not None:
            tok, sec, rounds = prior
            st_tok, st_s, n = st_tok + rounds * tok, st_s + rounds * sec, st_n + rounds
        return st_tok / st_s, pl_tok / pl_s, spread / math.sqrt(n) / (st_s / n)

    # A call's requests are new contexts: the guard's speculative evidence was measured on the
    # requests before them. At a new call it keeps at most CALL_CARRY rounds per request of the
    # batch, so a single request (batch 1, a round measures one prompt) is judged on its own
    # rounds within MIN_REALIZED - one hard prompt no longer keeps the next, easy one plain for
    # its whole length (bench/RESULTS.md, twenty-first session) - while at batch 4 and up
    # (a round averages several prompts, and a losing burst costs more) the verdict stands.
    CALL_CARRY = 2.0

    def new_requests(self, batch_size: int) -> None:
        """A call with ``batch_size`` new requests starts (the engine's generate / generate_batch)."""
        self._version += 1
        st = self._realized.get(self.bucket(batch_size))
        cap = self.CALL_CARRY * batch_size
        if st is not None and st[2] > cap:
            self._keep_speculative_rounds(st, cap)

    @staticmethod
    def _keep_speculative_rounds(st: List[float], rounds: float) -> None:
        """Scale a bucket's speculative guard sums (tokens, seconds, rounds, squared tokens) to
        ``rounds`` rounds of the same mean and spread (0: drop them)."""
        k = rounds / st[2] if st[2] > 0 else 0.0
        st[0], st[1], st[2], st[6] = st[0] * k, st[1] * k, st[2] * k, st[6] * k

    def _last_probe_lost(self, bucket: int) -> bool:
        """Whether the last ``PROBE_BURST`` speculative rounds of this bucket (in a plain bucket:
        its last probe) delivered fewer tokens per request per second than its plain steps do."""
        st, recent = self._realized.get(bucket), self._recent_spec.get(bucket)
        if st is None or not recent or st[5] < self.MIN_REALIZED[1] or st[4] <= 0:
            return False
        return sum(r[0] for r in recent) / sum(r[1] for r in recent) < st[3] / st[4]

    def realized_loses(self, bucket: int) -> bool:
        """Whether speculation has delivered fewer tokens per second than plain steps here: then
        the bucket decodes plainly whatever the model says (its probes keep measuring both), so
        that a model error never makes HeteroSpec slower than plain decoding for long."""
        # Not measured here yet: the verdict of the largest smaller bucket that was, if it lost
        # (speculation gains less as the batch grows: each request's tree adds rows to a forward
        # that is less and less bound by reading the weights). A bucket that inherits a loss
        # decodes plainly and probes, as if it had measured it.
        v = self._own_or_below(bucket, self._verdict)
        return v is not None and v[0] + self.GUARD_Z * v[2] < v[1]

    def held_plain(self, bucket: int) -> bool:
        """Whether the guard holds this bucket plain (:meth:`realized_loses`) and the bucket's
        last speculative rounds (its last probe burst, or the rounds that turned it) lost to its
        plain steps too: speculation measured losing, not just predicted to."""
        return self.realized_loses(bucket) and self._last_probe_lost(bucket)

    def _own_or_below(self, bucket: int, measure):
        """``measure(bucket)``, or where that is None, ``measure`` of the largest smaller bucket
        with realized sums where it is not None (None if none is)."""
        for b in [bucket] + sorted((b for b in self._realized if b < bucket), reverse=True):
            m = measure(b)
            if m is not None:
                return m
        return None

    FREQ_PRIOR = 32.0         # the calibration frequencies count as this many requests
    FREQ_HYSTERESIS = 0.05    # total variation before the frequencies in use move

    def _unchanged(self, name: str):
        """The result of ``name`` when no acceptance evidence arrived since it was computed: plain
        steps (most rounds of a plain bucket) change none, and recomputing per round cost ~0.25 ms
        of Python (0.5 % of a batch-8 step on the 2-core box)."""
        hit = self._derived.get(name)
        return hit[1] if hit is not None and hit[0] == self._evidence else None

    def _remember(self, name: str, value):
        self._derived[name] = (self._evidence, value)
        return value

    def _as_key(self, name: str) -> tuple:
        """``name``'s per-option dict (:meth:`bin_frequencies`, :meth:`bin_scale`) as sorted
        items, the form a plan's key holds: built once per evidence version, not per round."""
        cached = self._unchanged(name + ":key")
        if cached is None:
            cached = self._remember(name + ":key", tuple(sorted(getattr(self, name)().items())))
        return cached

    def bin_frequencies(self) -> Dict[int, Tuple[float, ...]]:
        """Per binning option that this workload has run: its bin frequencies, the calibration
        frequencies (as ``FREQ_PRIOR`` requests) plus the bins its requests landed in, rounded
        to 0.01; an option's entry moves only when the total variation reaches
        ``FREQ_HYSTERESIS``. Options not run keep the calibration frequencies."""
        cached = self._unchanged("bin_frequencies")
        if cached is not None:
            return dict(cached)
        dirty, self._freq_dirty = self._freq_dirty, set()
        for i, obs in self._bin_obs.items():
            if dirty is not None and i not in dirty:
                continue               # (its counts, so its frequencies, as last time)
            counts = self.tables.options[i].counts
            total, seen = float(sum(counts)), sum(obs)
            if total <= 0:
                continue
            blend = [(self.FREQ_PRIOR * c / total + o) / (self.FREQ_PRIOR + seen) for c, o in zip(counts, obs)]
            used = self._freq_used.get(i) or tuple(c / total for c in counts)
            if 0.5 * sum(abs(x - y) for x, y in zip(blend, used)) >= self.FREQ_HYSTERESIS:
                rounded = [round(x, 2) for x in blend]
                norm = sum(rounded)
                self._freq_used[i] = tuple(x / norm for x in rounded)
        return dict(self._remember("bin_frequencies", dict(self._freq_used)))

    PROBE_EVERY = 64          # rounds of a bucket between two rounds of the plan not chosen
    # A plain bucket's probe of speculation is a burst of this many speculative rounds (enough
    # for the guard, MIN_REALIZED), before which its speculative measurements are dropped: the
    # probe measures the workload of now (a new prompt, a new task), not the one that made the
    # bucket plain - older rounds would outweigh it for as long as the bucket stayed plain.
    PROBE_BURST = 5
    # ... ended early once its rounds delivered less than this fraction of the plain steps' rate
    PROBE_ABORT = 0.75
    MAX_BACKOFF = 2           # a plain bucket probes at least every PROBE_EVERY << MAX_BACKOFF rounds

    # Rounds of a speculating bucket that are plain steps besides every PROBE_EVERY-th: plain
    # steps are cheap to probe and the realized-throughput guard needs a few early on.
    EARLY_PLAIN_PROBES = (3, 6, 12, 24, 48)

    def round_plan(self, batch_size: int, context: Optional[int] = None, tokens_left: Optional[int] = None,
                   catchup: Optional[Callable[[], float]] = None, timed: bool = True) -> Plan:
        """The plan of the next round: :meth:`plan`, except that every ``PROBE_EVERY``-th round of
        a bucket runs the other kind (one plain step while speculating, one speculative round
        while decoding plainly), so that both time corrections stay measured - without it a
        wrong prediction for the mode not chosen would never be seen. A speculating bucket also
        probes plain steps at rounds ``EARLY_PLAIN_PROBES``.

        ``tokens_left``: the tokens the call's slowest running request still has to go; ``catchup``:
        a callable giving the tokens per request the draft would first catch up on (the engine
        asks it only here). Where the draft is behind, a round switches to speculation only if
        the rounds left repay the catch-up (:meth:`_repays`), and a plain bucket's probe burst
        waits for a call with a burst's rounds left (its measurement is what it is for; a
        burst cut short by the call's end measures a round or two for the same catch-up).
        For the same reason it waits for a ``timed`` round: the tail of a static batch, whose
        finished rows ride along until the batch is compacted, is not timed, and a burst there
        cost its rounds, taught the guard nothing and came back every ``PROBE_EVERY`` rounds
        (batch 16 falling to bucket 12 on the 2-core box, bench/RESULTS.md, fifty-third session)."""
        b = self.bucket(batch_size)
        c = self.context if context is None else self.context_bucket(context)
        stretch = self._stretch.get(b)
        if stretch is not None and stretch[1] == c and self._fresh(stretch[2]):
            # A plain stretch: nothing but plain steps observed since this bucket's last full
            # plan, and fewer than PLAIN_REPLAN of them. The plan and the probe spacing stand
            # (each plain step moves the plain-time correction and the guard's plain rate by a
            # few per cent of a step); only the probe schedule's counters move. A full plan per
            # round was 1-2 % of a plain step at batch 1-4 on the 2-core box (bench/RESULTS.md,
            # fifty-second session).
            spacing = stretch[3]
            if spacing is None:       # nothing to probe
                self._rounds[b] += 1
                return stretch[0]
            since = self._since_probe.get(b, 0) + 1
            if since < spacing:
                self._rounds[b] += 1
                self._since_probe[b] = since
                self._plain_ahead[b] = spacing - since - 1
                return stretch[0]
        self._stretch.pop(b, None)
        left = self._burst.get(b, 0)
        st = self._realized.get(b)
        if left > 0 and st is not None and st[2] > 0 and st[4] > 0 and st[5] >= self.MIN_REALIZED[1] \
                and st[0] / st[1] < self.PROBE_ABORT * st[3] / st[4]:
            # The probe's rounds so far lose clearly: end it (a burst costs several rounds at a
            # large batch) and let them count as a full measurement, so the guard acts on it.
            self._keep_speculative_rounds(st, self.MIN_REALIZED[0])
            left = self._burst[b] = 0
            self._version += 1
        plan = self.plan(batch_size, context)
        n = self._rounds[b] = self._rounds.get(b, 0) + 1
        self._plain_ahead[b] = 0
        if left > 0:                  # inside a probe burst (the guard is blind while it measures)
            self._burst[b] = left - 1
            fitted = self.fitted_plan(batch_size, context)
            if fitted.speculate or fitted.alternative is not None:
                return fitted if fitted.speculate else fitted.alternative
        if plan.alternative is None:
            if not plan.speculate:    # nothing to probe: plain for as long as nothing changes
                self._plain_ahead[b] = self.NEVER_PROBED
                self._stretch[b] = (plan, c, self._stamp(), None)
            return plan
        if plan.speculate:
            # (the spacing is a multiple of PROBE_EVERY: the guard is consulted only then) A
            # probe is two plain steps: the engine does not time the first after speculation (a
            # switch), so the second is what a plain step costs here.
            if self._probe_second.pop(b, False):
                return plan.alternative
            if (n % self.PROBE_EVERY == 0 and n % self._plain_probe_every(b) == 0) or n in self.EARLY_PLAIN_PROBES:
                self._probe_second[b] = True
                return plan.alternative
            return plan if self._repays(plan, tokens_left, catchup) else plan.alternative
        # A plain bucket probes speculation (a burst of PROBE_BURST rounds) every PROBE_EVERY
        # rounds, twice as long after each probe that lost (up to 2 ** MAX_BACKOFF times), and
        # further apart where the model prices a burst's loss above PROBE_LOSS_SHARE: a losing
        # probe costs a few steps' time plus the draft's catch-up over the plain stretch (at most
        # 2 * Engine.draft_window tokens).
        since = self._since_probe[b] = self._since_probe.get(b, 0) + 1
        spacing = self._probe_spacing(b, plan)
        if since >= spacing and timed and (tokens_left is None or tokens_left >= self.PROBE_BURST):
            self._since_probe[b] = 0
            self._backoff[b] = (min(self._backoff.get(b, 0) + 1, self.MAX_BACKOFF)
                                if self._last_probe_lost(b) else 0)
            st = self._realized.get(b)
            if st is not None:
                self._keep_speculative_rounds(st, 0.0)
            self._version += 1
            self._burst[b] = self.PROBE_BURST - 1
            return plan.alternative
        self._plain_ahead[b] = max(spacing - since - 1, 0)     # (0: a probe waits for a call with room)
        self._stretch[b] = (plan, c, self._stamp(), spacing)
        return plan

    # A plain stretch plans in full at least every PLAIN_REPLAN + 1 rounds (round_plan).
    PLAIN_REPLAN = 8

    def _stamp(self) -> Tuple[int, int]:
        return self._version, self._plain_seen

    def _fresh(self, stamp: Tuple[int, int]) -> bool:
        """Whether nothing but plain steps moved the policy since ``stamp`` (:meth:`_stamp`), and
        at most ``PLAIN_REPLAN`` of them."""
        moved = self._version - stamp[0]
        return moved <= self.PLAIN_REPLAN and moved == self._plain_seen - stamp[1]

    NEVER_PROBED = 1 << 30    # plain_rounds_ahead of a plain plan with no alternative to probe

    def plain_rounds_ahead(self, batch_size: int) -> int:
        """The plain rounds the probe schedule still has before this bucket's next probe burst,
        after :meth:`round_plan` planned a plain one (0 after a speculative round, a speculating
        bucket's plain probe, or inside a burst). A change of evidence (the guard turning, the
        batch shrinking to another bucket) may end the stretch sooner: the engine's next round
        then drafts from a thinner context, and the output is the target's either way."""
        return self._plain_ahead.get(self.bucket(batch_size), 0)

    # A plain bucket's probes may cost at most this share of its plain decoding time, priced by
    # the model's own (corrected) prediction of a speculative round; they come at most
    # PROBE_EVERY << MAX_PRICED_BACKOFF rounds apart. Where the model itself predicts
    # speculation far behind plain steps (batch 8 on a 2-core CPU: 26 % behind), a burst every
    # 64 rounds cost ~3 % of the time for nothing (bench/RESULTS.md, sixteenth session); a
    # close call, or a model the guard overruled, keeps the PROBE_EVERY spacing.
    PROBE_LOSS_SHARE = 0.01
    MAX_PRICED_BACKOFF = 4

    def _probe_spacing(self, bucket: int, plan: Plan) -> int:
        """Plain rounds between two probe bursts of a plain bucket: ``PROBE_EVERY`` (doubled after
        each losing probe, :attr:`MAX_BACKOFF`), or more where a burst loses more than
        ``PROBE_LOSS_SHARE`` of the plain time in between - as the model predicts it, or as the
        last burst measured it, whichever loss is larger. (A bucket the guard holds plain has a
        model that predicts a gain; only the measurement prices its probes.)"""
        every = self.PROBE_EVERY << self._backoff.get(bucket, 0)
        priced = max(self._predicted_probe_loss(plan), self._measured_probe_loss(bucket))
        if not math.isfinite(priced) or priced <= every:
            return every
        return min(int(math.ceil(priced)), max(every, self.PROBE_EVERY << self.MAX_PRICED_BACKOFF))

    def _predicted_probe_loss(self, plan: Plan) -> float:
        """A burst's loss in plain rounds / ``PROBE_LOSS_SHARE``, as the model predicts it (0 when
        it predicts a gain or nothing)."""
        exp = plan.expected or {}
        spec, plain = exp.get("speculative") or {}, exp.get("plain") or {}
        try:
            # a speculative round's time beyond what plain steps take for its tokens
            loss_ms = float(spec["ms"]) - float(spec["tokens"]) / float(plain["tokens"]) * float(plain["ms"])
            return max(0.0, self.PROBE_BURST * loss_ms / (self.PROBE_LOSS_SHARE * float(plain["ms"])))
        except (KeyError, TypeError, ZeroDivisionError):
            return 0.0

    def _catchup_ms(self, plan: Plan, extend_tokens: float) -> float:
        """The cost model's price of the draft's catch-up beyond a steady round of speculative
        ``plan``: ``extend_tokens`` (per request) against the tokens a round accepts (0 where
        the model has no prediction or nothing is in excess)."""
        exp = plan.expected or {}
        spec = exp.get("speculative") or {}
        if not plan.speculate or "tokens" not in spec:
            return 0.0
        B = max(int(exp.get("batch_size", 1)), 1)
        steady = float(spec["tokens"]) / B
        if extend_tokens <= steady:
            return 0.0
        return max(0.0, self.cost.draft_ms(B, 0, extend_tokens) - self.cost.draft_ms(B, 0, steady))

    def _repays(self, plan: Plan, left: Optional[int], catchup: Optional[Callable[[], float]]) -> bool:
        """Whether speculative ``plan``, whose first round catches the draft up on ``catchup()``
        tokens per request, gains that back in the ``left`` tokens the call's slowest request
        still has to go, as the model (with its time corrections) predicts: the saving of a
        round against plain steps for the same tokens, times the rounds left. (Near the end of a
        call that ran plainly - a batch falling to a bucket that speculates - the draft's
        deferred prompt pass alone can cost more than the few rounds left would save.)"""
        if left is None or catchup is None or not plan.speculate:
            return True
        exp = plan.expected or {}
        spec, plain = exp.get("speculative") or {}, exp.get("plain") or {}
        try:
            B = max(int(exp.get("batch_size", 1)), 1)
            per_round = float(spec["tokens"]) / B          # tokens per request a round gives
            saved_ms = per_round * float(plain["ms"]) - float(spec["ms"])
        except (KeyError, TypeError, ValueError):
            return True
        catch_ms = self._catchup_ms(plan, float(catchup()))
        if catch_ms <= 0.0:
            return True
        return saved_ms > 0.0 and saved_ms * max(left, 0) / max(per_round, 1.0) >= catch_ms

    def _measured_probe_loss(self, bucket: int) -> float:
        """The same from the last burst's rounds (:attr:`_recent_spec`) against the bucket's
        measured plain steps: each speculative round's time beyond what plain steps take for its
        tokens. 0 where the burst won. A bucket without both measurements takes the loss of the
        largest smaller bucket that has them (speculation gains less as the batch grows, as in
        :meth:`realized_loses`): a batch sweep's fresh bucket 2 or 4 after batch 1 lost spent its
        first burst - 3-6 % of a 96-token call at batch 2-4 on a 2-core CPU (bench/RESULTS.md,
        thirty-fifth session) - measuring what batch 1 had already shown."""
        loss = self._own_or_below(bucket, self._burst_loss)
        return 0.0 if loss is None else loss

    def _burst_loss(self, bucket: int) -> Optional[float]:
        st, recent = self._realized.get(bucket), self._recent_spec.get(bucket)
        if st is None or not recent or st[5] < self.MIN_REALIZED[1] or st[3] <= 0 or st[4] <= 0:
            return None
        # seconds a plain step; tokens per request per second (a plain step moves each request by
        # one token: seconds per token, which ageing leaves alone, not seconds over the count)
        plain_round_s, plain_rate = st[4] / st[3], st[3] / st[4]
        loss_s = sum(s - t / plain_rate for t, s, _ in recent) / len(recent)
        # A plain bucket's probe also pays the draft's catch-up over the plain stretch before it
        # (and over the prompts, where the call deferred their draft pass): observe takes it off
        # the rounds' times, which judge steady speculation, but every probe pays it again.
        catchup = sum(c for _, _, c in recent)
        return max(0.0, (self.PROBE_BURST * loss_s + catchup) / (self.PROBE_LOSS_SHARE * plain_round_s))

    # A speculating bucket whose rounds have delivered CLEAR_WIN times the plain steps' rate or
    # more probes plain steps PROBE_EVERY << CLEAR_WIN_BACKOFF rounds apart: each probe gives up
    # most of a round's gain (~1.5 % of the time at one per 64 rounds, measured on the built-in
    # pair), and a margin that wide is not lost to a drift a later probe would catch sooner.
    CLEAR_WIN = 1.25
    CLEAR_WIN_BACKOFF = 2

    def _plain_probe_every(self, bucket: int) -> int:
        r = self.realized(bucket)
        if r is not None and r[0] >= self.CLEAR_WIN * r[1]:
            return self.PROBE_EVERY << self.CLEAR_WIN_BACKOFF
        return self.PROBE_EVERY

    @property
    def costs(self) -> "_MemoCost":
        """The cost model as this policy prices its plans (answers remembered until a refit);
        the engine prices its context-lookup rounds with it (:mod:`heterospec.lookup`)."""
        return self._memo

    def refit(self) -> None:
        """Forget the fitted plans (after the cost model learned something new)."""
        self._version += 1
        self._plans = {}
        self._last_fit = {}
        self._shortlist = {}
        self._option_rank = {}
        self._memo = _MemoCost(self.cost)
        self._option_fits = {}

    def time_scale(self, bucket: int) -> float:
        """Observed / predicted speculative round time at this batch bucket, in steps of 0.05
        within [0.5, 3]. Until ``MIN_ROUNDS`` speculative rounds were timed at some bucket:
        the bucket's plain-step correction (:meth:`plain_scale`). What made plain steps slower
        or faster than the model on this device (its speed, longer contexts) makes rounds so
        too, and a plain correction alone, 1.2 in the tail of batch-16 calls, predicted
        speculation 25 % ahead there where it lost (bench/RESULTS.md, fifty-third session)."""
        if bucket not in self._time_used and not any(v[2] >= self.MIN_ROUNDS for v in self._time.values()):
            return self.plain_scale(bucket)
        return self._time_ratio(self._time, self._time_used, bucket)

    def plain_scale(self, bucket: int) -> float:
        """Observed / predicted plain-step time at this batch bucket (as :meth:`time_scale`)."""
        return self._time_ratio(self._plain, self._plain_used, bucket)

    def _time_ratio(self, sums: Dict[int, List[float]], used_by_bucket: Dict[int, float], bucket: int) -> float:
        obs, pred, n = sums.get(bucket, (0.0, 0.0, 0.0))
        if n < self.MIN_ROUNDS:
            # Not measured here yet: the nearest measured batch size's correction (the cost
            # model's error is mostly the device's, not the batch size's). A batch shrinking
            # through 16, 12, 8, ... would otherwise start every bucket from the raw model.
            near = [(abs(math.log2(b) - math.log2(bucket)), b) for b, v in sums.items() if v[2] >= self.MIN_ROUNDS]
            return used_by_bucket.get(min(near)[1], 1.0) if near else used_by_bucket.get(bucket, 1.0)
        used = used_by_bucket.get(bucket, 1.0)
        if pred > 0:
            r = min(3.0, max(0.5, obs / pred))
            if abs(r - used) >= self.HYSTERESIS:
                used = used_by_bucket[bucket] = round(r / 0.05) * 0.05
        return used

    MIN_ROUNDS = 8.0          # timed rounds before the time correction applies

    # While a bucket speculates, its plain evidence (the guard's plain rate, the plain-step
    # correction) comes from probes: one timed plain step every PROBE_EVERY rounds, or every
    # PROBE_EVERY << CLEAR_WIN_BACKOFF where speculation looks a clear win. Forgotten only by
    # newer plain steps, a few steps timed while another process held a core stayed the
    # bucket's plain evidence for good: plain steps read 1.7x their cost, speculation looked a
    # clear win, probes came every 256 rounds and could not outweigh them, and batch 1 drafted
    # at 0.90x autoregressive through a batch sweep's ~1,900 rounds of it (bench/RESULTS.md,
    # sixty-eighth session).
    # So every timed speculative round of the bucket ages that evidence by PLAIN_AGE: its rates
    # and ratios stay, its weight against the next probe falls (after 64 rounds to about half,
    # after 256 to 8 %). Their counts stay (the guard's MIN_REALIZED, the correction's
    # MIN_ROUNDS: whether the bucket was measured at all), or a bucket probed every 64 rounds
    # would never again hold enough plain steps for the guard to act.
    PLAIN_AGE = 0.99

    def _age_plain_evidence(self, bucket: int) -> None:
        st = self._realized.get(bucket)
        if st is not None:
            st[3], st[4] = st[3] * self.PLAIN_AGE, st[4] * self.PLAIN_AGE
        obs = self._plain.get(bucket)
        if obs is not None:
            self._plain[bucket] = [obs[0] * self.PLAIN_AGE, obs[1] * self.PLAIN_AGE, obs[2]]

    def position_scale(self) -> Tuple[float, ...]:
        """Per draft position ``j = 1..``: observed / predicted ``P(accepted >= j)`` on this
        workload, in steps of 0.05 within [0.05, 2], changed only by HYSTERESIS or more.

        The first position's scale is its own ratio once it has ``MIN_OBSERVED`` predicted
        acceptances. Every later position corrects the one before it: its scale is the previous
        scale times the ratio of what it accepted to what the previous scale predicts for it,
        shrunk towards 1 by ``POSITION_PRIOR`` predicted acceptances. A position with little
        evidence so takes the scale of the position before it (drafting deeper, when that then
        pays, measures it), and a few unlucky deep rounds lower it by a little, not to the floor:
        with a shallow plan nothing deep is measured again, and a floor reached from 11
        predicted acceptances stayed for good (bench/RESULTS.md, 26 Nov). Recomputed only when
        acceptance evidence arrived (the plain steps of a plain bucket bring none)."""
        cached = self._unchanged("position_scale")
        if cached is not None:
            return cached
        self._set_positions_used()
        return self._remember("position_scale", tuple(self._pos_used))

    def _set_positions_used(self, hysteresis: bool = True) -> None:
        """The scales in use (``_pos_used``) from the sums, position by position; a scale moves
        only by ``HYSTERESIS`` or more unless ``hysteresis`` is False."""
        prev = 1.0
        for j in range(len(self._pos_used)):
            r = self._position_ratio(j, prev)
            if r is None:
                self._pos_used[j] = prev
            elif not hysteresis or abs(r - self._pos_used[j]) >= self.HYSTERESIS:
                self._pos_used[j] = round(r / 0.05) * 0.05
            prev = self._pos_used[j]

    def _position_ratio(self, j: int, prev: float) -> Optional[float]:
        """Position ``j``'s measured scale given the scale in use at ``j - 1`` (``position_scale``),
        within [0.05, 2]; None for a first position measured less than ``MIN_OBSERVED``."""
        obs, pred = self._pos_obs[j], self._pos_pred[j]
        if j == 0:
            if pred < self.MIN_OBSERVED:
                return None
            r = obs / pred
        else:
            r = prev * (obs + self.POSITION_PRIOR) / (pred * prev + self.POSITION_PRIOR)
        return min(2.0, max(0.05, r))

    # What the tables' plans accepted on prompts held out from the calibration (tables.held_out)
    # counts as this many predicted acceptances per position of a fresh workload's evidence: the
    # policy starts from it rather than from the tables as they are, and forgets it as the
    # workload's own rounds come in (FORGET): more than MIN_OBSERVED, so it is in use from the
    # first round, and a few dozen rounds' worth at the first position, so a prompt's own rounds
    # outweigh it. (The calibration prompts resemble the draft's training data; real requests
    # accept less.)
    HELD_OUT_WEIGHT = 16.0

    def _start_from_held_out(self) -> None:
        held = self.tables.held_out
        if not held:
            return
        for j, r in enumerate(held["position_scale"][:len(self._pos_obs)]):
            self._pos_obs[j], self._pos_pred[j] = float(r) * self.HELD_OUT_WEIGHT, self.HELD_OUT_WEIGHT
        self._set_positions_used(hysteresis=False)   # in use at once (no hysteresis from 1)

    POSITION_PRIOR = 8.0      # predicted acceptances behind "as the position before it"
    HYSTERESIS = 0.1          # a scale in use changes only when the measurement moved this much

    # The position scale corrects every bin alike; where the tables' bins are off by different
    # amounts on this workload (e.g. the easy bins as calibrated, the hard ones far below: vLLM's
    # drafter on chat prompts), one scale per position makes the easy bins look as bad as the
    # average and the policy drafts too little where it pays. Per bin: its accepted drafts over
    # what the tables with the position scale in use predict for its rounds (once that is
    # MIN_OBSERVED or more), shrunk towards 1 by BIN_PRIOR predicted acceptances, within [0.25, 4], in steps of 0.05 moved by HYSTERESIS.
    # Where the position scale explains a bin's rounds, its factor is 1.
    BIN_PRIOR = 8.0

    def bin_scale(self) -> Dict[int, Tuple[float, ...]]:
        """Per binning option this workload has run: a factor per bin on the position-corrected
        acceptance (1 for a bin with no observations)."""
        cached = self._unchanged("bin_scale")
        if cached is not None:
            return dict(cached)
        pos = self.position_scale()
        dirty, self._scale_dirty = self._scale_dirty, set()
        if pos != self._scale_pos:
            dirty, self._scale_pos = None, pos     # every option's prediction moved
        for i, sums in self._bin_acc.items():
            if dirty is not None and i not in dirty:
                continue               # (its sums and the position scale as last time)
            used = list(self._bin_scale_used.get(i) or [1.0] * len(sums))
            # (runs after every speculative round: map, not a generator, ~4x less Python per bin)
            scale = list(pos) + [pos[-1]] * (len(sums[0][1]) - len(pos)) if sums and pos else pos
            for b, (obs_j, pred_j) in enumerate(sums):
                obs = sum(obs_j)
                pred = sum(map(operator.mul, pred_j, scale))
                if pred < self.MIN_OBSERVED:      # as the position scale: measured enough first
                    continue
                r = min(4.0, max(0.25, (obs + self.BIN_PRIOR) / (pred + self.BIN_PRIOR)))
                if abs(r - used[b]) >= self.HYSTERESIS:
                    used[b] = round(r / 0.05) * 0.05
            self._bin_scale_used[i] = tuple(used)
        return dict(self._remember("bin_scale", dict(self._bin_scale_used)))

    MIN_OBSERVED = 10.0       # predicted acceptances of a position before its own scale applies
    FORGET = 0.995            # per round: a half-life of about 140 rounds

    def state(self) -> dict:
        """What the online correction has learned (saved between processes by the engine)."""
        return {"position": {"observed": list(self._pos_obs), "predicted": list(self._pos_pred),
                             "used": list(self._pos_used)},
                "bins": {str(i): list(v) for i, v in self._bin_obs.items()},
                "bins_used": {str(i): list(v) for i, v in self._freq_used.items()},
                "bin_accept": {str(i): [list(x) for x in v] for i, v in self._bin_acc.items()},
                "bin_scale_used": {str(i): list(v) for i, v in self._bin_scale_used.items()},
                "time": {str(b): list(v) for b, v in self._time.items()},
                "plain": {str(b): list(v) for b, v in self._plain.items()},
                "time_used": {str(b): v for b, v in self._time_used.items()},
                "plain_used": {str(b): v for b, v in self._plain_used.items()},
                # the guard's sums: the next process starts where this one's guard stood
                "realized": {str(b): list(v) for b, v in self._realized.items()},
                "cost_model": self._cost_stamp()}

    def _cost_stamp(self) -> Optional[str]:
        """When the cost model was measured: the time sums are corrections *of that model*."""
        stamp = getattr(self.cost, "stamp", None)
        if isinstance(stamp, str):
            return stamp
        prov = getattr(self.cost, "provenance", None)
        return str(prov.get("date")) if isinstance(prov, dict) and prov.get("date") else None

    def save_state(self) -> None:
        """Write :meth:`state` to ``state_path`` (if any); a failed write is not an error."""
        if self.state_path is None:
            return
        from ._io import write_json_atomic
        try:
            write_json_atomic(self.state_path, self.state())
        except OSError:
            pass

    def load_state(self, state: dict) -> None:
        try:
            pos = state["position"]
            obs, pred, used = ([float(x) for x in pos[k]] for k in ("observed", "predicted", "used"))
            if not len(obs) == len(pred) == len(used) == len(self._pos_used):
                return                  # measured with other tables: start from these
            time_ = {int(b): [float(x) for x in v] for b, v in state["time"].items()}
            time_used = {int(b): float(v) for b, v in state["time_used"].items()}
            plain = {int(b): [float(x) for x in v] for b, v in state.get("plain", {}).items()}
            plain_used = {int(b): float(v) for b, v in state.get("plain_used", {}).items()}
            bins = {int(i): [float(x) for x in v] for i, v in state.get("bins", {}).items()}
            bins_used = {int(i): tuple(float(x) for x in v) for i, v in state.get("bins_used", {}).items()}
            realized = {int(b): [float(x) for x in v] for b, v in state.get("realized", {}).items()}
            npos = len(self._pos_used)
            bin_acc = {int(i): [[[float(x) for x in row] for row in pair] for pair in v]
                       for i, v in state.get("bin_accept", {}).items()}
            bin_scale_used = {int(i): tuple(float(x) for x in v)
                              for i, v in state.get("bin_scale_used", {}).items()}
            if any(len(pair) != 2 or any(len(row) != npos for row in pair) for v in bin_acc.values() for pair in v):
                return                  # not these sums: start from the tables
            if any(len(v) not in (6, 7) or min(v) < 0 for v in realized.values()):
                return                  # not the guard's sums: start from the tables
            # (a state saved before the squared tokens were kept: no spread, the plain verdict)
            realized = {b: v + [(v[0] * v[0] / v[2]) if v[2] > 0 else 0.0] if len(v) == 6 else v
                        for b, v in realized.items()}
            nopt = len(self.tables.options)
            for d in (bins, bins_used, bin_acc, bin_scale_used):
                if any(not 0 <= i < nopt or len(v) != len(self.tables.options[i].counts) for i, v in d.items()):
                    return              # measured with other tables: start from these
        except (KeyError, TypeError, ValueError, AttributeError):
            return                      # an unreadable state is ignored: start from the tables
        if state.get("cost_model") != self._cost_stamp():
            # The device's cost model was measured again since: the time corrections and the
            # guard's sums judged the old one; what was learnt about acceptance still holds.
            time_, time_used, plain, plain_used, realized = {}, {}, {}, {}, {}
        self._pos_obs, self._pos_pred, self._pos_used = obs, pred, used
        self._time, self._time_used, self._plain, self._plain_used = time_, time_used, plain, plain_used
        self._bin_obs, self._freq_used = bins, bins_used
        self._bin_acc, self._bin_scale_used = bin_acc, bin_scale_used
        self._freq_dirty = self._scale_dirty = None
        self._evidence += 1
        self._realized = realized
        self.refit()

    def observe(self, plan: Plan, bins: Sequence[int], accepted: Sequence[int],
                seconds: Optional[float] = None, drafted: Optional[Sequence[int]] = None,
                extend_tokens: Optional[float] = None, progress: Optional[float] = None,
                batch_size: Optional[int] = None, context: Optional[int] = None, one_off_s: float = 0.0) -> None:
        """Record a round of ``plan``: for a speculative round each request's bin and accepted
        drafts, and the round's wall time; for a plain step its wall time only. A request counts
        for the positions its bin's action drafted (none when the bin verifies the root only),
        or the first ``drafted[r]`` of them where the caller verified fewer (an engine cap).
        ``extend_tokens``: the mean number of tokens the draft extended over at the start of this
        speculative round. After plain steps (or for a request's first round: its prompt) that is
        more than a round of steady speculation extends over; the cost model's price of the
        excess is taken off ``seconds``, so the time corrections and the guard judge steady
        speculation rather than the one-off catch-up. ``one_off_s``: measured seconds of the round
        spent on the call rather than on the round (the draft's prompt pass, deferred from the
        prefill of a call that started plain), taken off ``seconds`` in full and counted as
        catch-up; priced instead, a batch-4 prompt pass read as 4 ms where it took 37, and the
        rest taught the time correction that rounds cost 2.65x the model (bench/RESULTS.md,
        sixty-fourth session). A round or step timed above ``STALL_FACTOR`` times what is
        expected of it counts as that much (:func:`~heterospec.timing.unstalled`), here and in
        the sums of the corrections. ``progress``: the tokens per request the guard credits the
        round with (default: the mean over the requests, what a continuous batch gains); a static
        batch ends with its slowest request, and its caller passes how far the round moved the
        slowest one. ``batch_size``: the requests the round ran for, where
        the plan was fitted at its batch bucket's smallest size: the predictions the time
        corrections compare with are scaled to it by the cost model's plain steps, so that a
        correction measures the model's error and not the bucket's width. (15 requests priced
        as 12 read as plain steps 1.3x slower than modelled; buckets not measured inherited that
        correction, for plain steps only, and predicted speculation 30 % ahead of plain steps in
        a static batch's tail, where it lost: bench/RESULTS.md, fifty-third session.) ``context``:
        the requests' mean context length in this round (default: the plan's context): the
        guard keeps its times scaled to one context (:attr:`GUARD_CONTEXT`)."""
        self._version += 1
        expected = plan.expected or {}
        width = 1.0          # the cost model's plain step at batch_size / at the fitted size
        if batch_size is not None and "batch_size" in expected and int(batch_size) != int(expected["batch_size"]):
            width = self._memo.plain_ms(int(batch_size)) / self._memo.plain_ms(int(expected["batch_size"]))
        catchup_s = 0.0
        if seconds is not None and one_off_s > 0.0:
            # (a round that was all one-off work times nothing)
            seconds, catchup_s = (seconds - one_off_s, one_off_s) if seconds > one_off_s else (None, 0.0)
        if seconds is not None and extend_tokens is not None and plan.speculate and expected.get("speculative"):
            priced = min(0.5 * seconds, 1e-3 * self._catchup_ms(plan, extend_tokens))
            seconds -= priced
            catchup_s += priced
        expect_ms = (expected.get("speculative" if plan.speculate else "plain") or {}).get("ms")
        if seconds is not None and expect_ms:       # (with the time correction in use)
            seconds = unstalled(seconds, 1e-3 * float(expect_ms) * width)
        if "batch_size" in expected:
            ob = self.bucket(int(expected["batch_size"]))
            self._observed_rounds[ob] = self._observed_rounds.get(ob, 0) + 1
        if seconds is not None and seconds > 0:
            self._round_s += seconds
        if plan.speculate and seconds is not None and seconds > 0 and "batch_size" in expected:
            self._age_plain_evidence(self.bucket(int(expected["batch_size"])))
        if seconds is not None and seconds > 0 and "batch_size" in expected and (bins or not plan.speculate):
            norm = self._context_norm(int(expected["batch_size"]), context if context is not None
                                      else expected.get("context"))
            guard_s, guard_catchup_s = seconds * norm, catchup_s * norm
            st = self._realized.setdefault(self.bucket(int(expected["batch_size"])), [0.0] * 7)
            k = 0 if plan.speculate else 3
            if progress is not None:
                tokens = float(progress)
            else:
                tokens = sum(a + 1.0 for a in accepted) / len(accepted) if plan.speculate else 1.0
            f = self.REALIZED_FORGET
            st[k], st[k + 1], st[k + 2] = st[k] * f + tokens, st[k + 1] * f + guard_s, st[k + 2] * f + 1.0
            if plan.speculate:
                st[6] = st[6] * f + tokens * tokens
                recent = self._recent_spec.setdefault(self.bucket(int(expected["batch_size"])), [])
                recent.append((tokens, guard_s, guard_catchup_s))
                del recent[:-self.PROBE_BURST]
        if not plan.speculate:
            self._plain_seen += 1       # (the one version move of this observe: see _fresh)
            predicted_ms = (expected.get("plain") or {}).get("ms")
            if seconds is not None and predicted_ms and "batch_size" in expected:
                bucket = self.bucket(int(expected["batch_size"]))
                obs, pred, n = self._plain.get(bucket, (0.0, 0.0, 0.0))
                base = predicted_ms / float(expected.get("plain_scale", 1.0)) * width
                self._plain[bucket] = [obs * self.FORGET + unstalled(1e3 * seconds, base), pred * self.FORGET + base,
                                       n * self.FORGET + 1.0]
            return
        self._evidence += 1             # acceptance evidence may change below (bin_scale, bin_frequencies)
        if plan.predicted_accept is None:
            return
        predicted_ms = expected.get("speculative", {}).get("ms")
        if seconds is not None and predicted_ms:
            bucket = self.bucket(int((plan.expected or {}).get("batch_size", 1)))
            obs, pred, n = self._time.get(bucket, (0.0, 0.0, 0.0))
            # The prediction already carries the time scale it was fitted with: undo it.
            base = predicted_ms / float((plan.expected or {}).get("time_scale", 1.0)) * width
            self._time[bucket] = [obs * self.FORGET + unstalled(1e3 * seconds, base), pred * self.FORGET + base,
                                  n * self.FORGET + 1.0]
        if plan.survival is None:
            return
        opt_i = expected.get("option")
        f = self.FORGET    # (the forgetting below: list comprehensions, ~2x less Python than index loops)
        if opt_i is not None and 0 <= opt_i < len(self.tables.options) and bins:
            obs = self._bin_obs.setdefault(opt_i, [0.0] * plan.num_bins)
            if self._freq_dirty is not None:
                self._freq_dirty.add(opt_i)
            for b in bins:
                if 0 <= b < len(obs):
                    obs[:] = [x * f for x in obs]
                    obs[b] += 1.0
        npos = len(self._pos_obs)
        sums = self._bin_acc.setdefault(opt_i, [[[0.0] * npos, [0.0] * npos] for _ in range(plan.num_bins)]) \
            if opt_i is not None and 0 <= opt_i < len(self.tables.options) \
            and len(self.tables.options[opt_i].counts) == plan.num_bins else None
        if sums is not None and self._scale_dirty is not None:
            self._scale_dirty.add(opt_i)
        for r, (b, a) in enumerate(zip(bins, accepted)):
            if 0 <= b < plan.num_bins:
                n = len(self._pos_obs) if drafted is None else int(drafted[r])
                if sums is not None and plan.survival[b][:n]:
                    for obs_j, pred_j in sums:
                        obs_j[:] = [x * f for x in obs_j]
                        pred_j[:] = [x * f for x in pred_j]
                    for j, sj in enumerate(plan.survival[b][:min(n, npos)]):
                        sums[b][0][j] += 1.0 if a > j else 0.0
                        sums[b][1][j] += sj
                # Every position is forgotten, also those this action did not draft: evidence
                # from rounds long ago (another prompt, another plan) fades into the prior.
                self._pos_obs[:] = [x * f for x in self._pos_obs]
                self._pos_pred[:] = [x * f for x in self._pos_pred]
                for j, sj in enumerate(plan.survival[b][:n]):
                    self._pos_obs[j] += 1.0 if a > j else 0.0
                    self._pos_pred[j] += sj

    def max_tree_nodes(self, batch_size: int) -> int:
        # plans move within a call (corrections, guard, probes): any action of the grid may come
        return max(n for n in self.tables.nodes if self.max_nodes is None or n - 1 <= self.max_nodes) - 1

    def needs_draft(self, batch_size: int) -> bool:
        # the model's plans, not the guard's: a guarded bucket still probes speculation
        return any(self.fitted_plan(b).speculate for b in {self.bucket(x) for x in range(1, batch_size + 1)})


class ForcedPolicy(FittedPolicy):
    """The fitted policy with one kind of round forced: every round its fitted speculative plan
    (``speculate=True``; the guard, probes and plain steps never chosen), or every round a plain
    step with the probe schedule out of sight (cold steps, as in a bucket held plain). It learns
    as the fitted policy does, so its time sums (``_time``, ``_plain``) are the engine's own
    rounds timed against the cost model: :func:`heterospec.costmodel.measure_in_use`."""

    name = "fitted"

    def __init__(self, tables: AcceptanceTables, cost, config: SpecConfig, speculate: bool, **kw) -> None:
        super().__init__(tables, cost, config, **kw)
        self.speculate = bool(speculate)

    def plan(self, batch_size: int, context: Optional[int] = None) -> Plan:
        plan = self.fitted_plan(batch_size, context)
        if plan.speculate != self.speculate and plan.alternative is not None:
            plan = plan.alternative
        return plan

    def round_plan(self, batch_size: int, context: Optional[int] = None, tokens_left: Optional[int] = None,
                   catchup: Optional[Callable[[], float]] = None, timed: bool = True) -> Plan:
        plan = self.plan(batch_size, context)
        self._plain_ahead[self.bucket(batch_size)] = 0 if plan.speculate else self.NEVER_PROBED
        return plan

    def needs_draft(self, batch_size: int) -> bool:
        # plain: as a bucket the guard holds plain (the draft kept, its prompt pass deferred)
        return self.speculate or super().needs_draft(batch_size)

    def time_sums(self, speculative: bool) -> Dict[int, Tuple[float, float, float]]:
        """Per batch bucket: (observed ms, predicted ms, rounds) of the rounds timed, forgotten
        as the online corrections forget them."""
        return {b: tuple(v) for b, v in (self._time if speculative else self._plain).items()}


def _buckets():
    """1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ..."""
    yield from (1, 2, 3)
    b = 4
    while True:
        yield b
        yield b * 3 // 2
        b *= 2


