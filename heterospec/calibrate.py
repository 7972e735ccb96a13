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
import math
import os
import warnings
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .config import CALIBRATION_LABELS
from .entropy import BINS_FILENAME, EntropyBins, bins_path_to_write


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


# ---------------------------------------------------------------------------------------------
# Acceptance tables for the fitted policy
# ---------------------------------------------------------------------------------------------
TABLE_LABELS = ("accept", "accept_max")


def default_grid(config) -> Tuple[List[int], List[int]]:
    """Action grid of the traces: draft forwards 0 .. depth + max(2, ceil(depth / 2)) + 1 and
    verified nodes (root included) from 1 to about twice ``total_tokens``."""
    import math
    D = config.depth + max(2, math.ceil(config.depth / 2)) + 1
    cap = max(2 * config.total_tokens, 16)
    nodes = sorted({n for n in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 128)
                    if n <= cap} | {config.total_tokens})
    return list(range(D + 1)), nodes


def _layer_of(C: int, k: int) -> np.ndarray:
    """Candidate layer (1 = the root's children) of each candidate index."""
    c = np.arange(C)
    return np.where(c < k, 1, 2 + (c - k) // (k * k))


def collect_traces(engine, prompts: Sequence, max_new_tokens: int = 128, depths: Optional[List[int]] = None,
                   nodes: Optional[List[int]] = None, entropy_ks: Optional[Sequence[int]] = None,
                   batch_size: int = 4, progress: bool = True, chat: bool = True,
                   decide_depths: Optional[Sequence[int]] = None) -> dict:
    """Greedy rounds on ``prompts`` that draft the deepest tree of the grid, verify the union of
    every action's selection in one target forward, and record per round: the accepted length of
    every action ``(forwards d, nodes N)`` (exact: the target's argmax is known at every node any
    action could select, and the selection of each action is recomputed with the engine's op),
    and ``H(P*)`` read after every number of forwards for every K. Output follows the target's
    greedy text (the verification is the engine's)."""
    import torch
    from tqdm.auto import tqdm

    from . import ops
    from .config import SamplingParams
    from .engine import _score_ranks
    from .policy import Plan

    cfg = engine.config
    k = cfg.top_k
    g_depths, g_nodes = default_grid(cfg)
    depths = list(depths or g_depths)
    nodes = list(nodes or g_nodes)
    ks = sorted(set(entropy_ks or [k, min(2 * k, 64)]))
    if not ks or any(K < k or K > 64 for K in ks):
        raise ValueError(f"collect_traces: entropy K must be in [top_k={k}, 64], got {ks}")
    D = max(depths)
    C = k + D * k * k
    nodes = [n for n in nodes if n - 1 <= C]
    layer = torch.as_tensor(_layer_of(C, k))
    plan = Plan("trace", decide_depth=D, entropy_k=max(ks), edges=[], depth=[D], budget=[C], binned=False)
    params = SamplingParams()
    decide = [d for d in range(0, min(cfg.depth, D - 1) + 1)] if decide_depths is None else \
        sorted({int(d) for d in decide_depths if 0 <= int(d) < D})
    G = [(di, ni) for di in range(len(depths)) for ni in range(len(nodes))]
    out = {"accept": [], "tcr": [], "entropy": {(d0, K): [] for d0 in decide for K in ks}}
    # The engine's own tree (depth, total_tokens): its TCR is the paper's calibration label.
    g_default = G.index((depths.index(cfg.depth), nodes.index(cfg.total_tokens)))
    encoded = [engine._encode(p, chat) for p in prompts]
    bar = tqdm(total=len(encoded), desc="calibrating (traces)", disable=not progress, unit="prompt")
    with torch.inference_mode():
        for start in range(0, len(encoded), batch_size):
            ids = encoded[start:start + batch_size]
            # room for the last round: a path accepted past max_new_tokens plus the whole tree
            cache_len = max(len(p) for p in ids) + max_new_tokens + 2 * C + 2
            if cache_len > engine.max_length:
                raise ValueError(f"calibration prompt {start}: too long for max_length {engine.max_length}")
            st = engine._prefill(ids, "heterospec", params, None, cache_len, max_new_tokens, None, True)
            B = len(ids)
            while st.active():
                active = st.active()
                tree = engine._draft_tree(st, cfg, plan, trace_ks=ks)
                # H(P*) after d0 forwards, for every d0 and K (P* from the unmasked tree).
                for d0 in decide:
                    base = 0 if d0 == 0 else k + (d0 - 1) * k * k
                    pstar = engine._pstar(tree.scores, tree.local, base, k, cfg, first_layer=d0 == 0)
                    for K in ks:
                        h = tree.path_entropy[K].gather(1, pstar[:, None])[:, 0].tolist()
                        out["entropy"][(d0, K)].extend(h[b] for b in active)
                # Every action's selection, recomputed by the engine's op on masked scores.
                rows_scores = []
                for di, ni in G:
                    keep = layer <= depths[di] + 1
                    rows_scores.append(torch.where(keep[None, :], tree.scores, torch.full_like(tree.scores, -math.inf)))
                sc = torch.stack(rows_scores, 1).reshape(B * len(G), C)                    # [B*G, C]
                par = tree.parents[:, None, :].expand(B, len(G), C).reshape(B * len(G), C).contiguous()
                bud = torch.tensor([nodes[ni] - 1 for _, ni in G] * B, dtype=torch.int64)
                sel, _, num = ops.select_tree_nodes(sc, par, bud, max(nodes) - 1)
                sel = sel.reshape(B, len(G), -1).tolist()
                num = num.reshape(B, len(G)).tolist()
                orig_scores = tree.scores.tolist()
                union = torch.zeros(B, C, dtype=torch.bool)
                for b in range(B):
                    for g in range(len(G)):
                        for c in sel[b][g][1:num[b][g]]:
                            union[b, c] = True
                tree.scores = torch.where(union, tree.scores, torch.full_like(tree.scores, -math.inf))
                tree.budget = union.sum(1)
                verdict = engine._verify(st, tree, Plan("trace", decide_depth=0, entropy_k=k, edges=[], depth=[0],
                                                        budget=[C], binned=False), params)
                cand = verdict.tree_cand.tolist()
                top1 = verdict.target_top1.tolist()
                toks = tree.tokens.tolist()
                parents = tree.parents.tolist()
                for b in active:
                    pos_of = {c: p for p, c in enumerate(cand[b]) if c >= 0}
                    children = {}
                    for c in pos_of:
                        children.setdefault(parents[b][c], {})[toks[b][c]] = c
                    acc = np.zeros((len(depths), len(nodes)), dtype=np.int16)
                    for g, (di, ni) in enumerate(G):
                        chosen = set(sel[b][g][1:num[b][g]])
                        cur, pos, a = -1, 0, 0
                        while True:
                            c = children.get(cur, {}).get(top1[b][pos])
                            if c is None or c not in chosen:
                                break
                            cur, pos, a = c, pos_of[c], a + 1
                        acc[di, ni] = a
                        if g == g_default:
                            chosen_list = sel[b][g][1:num[b][g]]
                            ranks = _score_ranks([orig_scores[b][c] for c in chosen_list])
                            out["tcr"].append(ranks[chosen_list.index(cur)] if a > 0 else num[b][g])
                    out["accept"].append(acc)
                engine._commit(st, tree, verdict, max_new_tokens, None, 0.0, 0.0)
            bar.update(len(ids))
            bar.set_postfix(rounds=len(out["accept"]))
    bar.close()
    return {"accept": np.stack(out["accept"]) if out["accept"] else np.zeros((0, len(depths), len(nodes))),
            "tcr": np.asarray(out["tcr"], dtype=np.float64),
            "entropy": {key: np.asarray(v) for key, v in out["entropy"].items()},
            "depths": depths, "nodes": nodes, "entropy_ks": ks, "decide_depths": decide, "top_k": k}


def fit_tables(traces: dict, labels: Sequence[str] = TABLE_LABELS, provenance: Optional[dict] = None,
               min_leaf_fraction: float = 0.02):
    """Binning options (every decision depth x K x label) with their per-bin acceptance tables.

    Labels for the CART fit: ``"accept"`` = accepted drafts of the engine's own tree,
    ``"accept_max"`` = of the deepest, widest action of the grid. Bins hold at least
    ``min_leaf_fraction`` of the rounds (tiny bins give noisy tables)."""
    from .policy import AcceptanceTables, BinningOption

    acc = traces["accept"].astype(np.float64)                    # [R, depths, nodes]
    R = acc.shape[0]
    if R < 16:
        raise ValueError(f"fit_tables: need at least 16 calibration rounds, got {R}")
    depths, nodes = traces["depths"], traces["nodes"]
    cfg_d, cfg_n = traces["default_action"]
    ref = {"accept": acc[:, depths.index(cfg_d), nodes.index(cfg_n)], "accept_max": acc[:, -1, -1]}
    options, report = [], []
    for d0 in traces["decide_depths"]:
        for K in traces["entropy_ks"]:
            x = traces["entropy"][(d0, K)]
            for label in labels:
                y = ref[label]
                bins = fit_bins(x, y, min_samples_leaf=max(8, int(min_leaf_fraction * R)))
                idx = np.array([bins.bin_of(float(v)) for v in x])
                counts = [int((idx == i).sum()) for i in range(bins.num_bins)]
                tables = [np.round(acc[idx == i].mean(0), 4).tolist() if counts[i] else
                          np.zeros((len(depths), len(nodes))).tolist() for i in range(bins.num_bins)]
                means = [float(y[idx == i].mean()) for i in range(bins.num_bins) if counts[i]]
                monotone = all(b <= a + 1e-12 for a, b in zip(means, means[1:]))
                options.append(BinningOption(d0, int(K), label, bins.edges, counts, tables))
                # How much of the label's variance the bins explain (R^2 of the bin means).
                fitted = np.array([means[min(i, len(means) - 1)] for i in idx]) if means else y
                r2 = 1.0 - float(((y - fitted) ** 2).sum()) / max(float(((y - y.mean()) ** 2).sum()), 1e-12)
                report.append({"decide_depth": d0, "entropy_k": int(K), "label": label, "bins": bins.num_bins,
                               "mean_label_by_bin": [round(m, 3) for m in means],
                               "accept_falls_with_entropy": monotone, "r2": round(r2, 4)})
    prov = dict(provenance or {})
    prov["rounds"] = R
    prov["options"] = report
    return AcceptanceTables(int(traces["top_k"]), list(depths), list(nodes), options, prov)


def _tables_provenance(engine, prompts, source: str, max_new_tokens: int, **extra) -> dict:
    """Where acceptance tables came from (saved in the tables file)."""
    return {"target": _where(getattr(engine.target, "name_or_path", None)), "draft": _where(engine.draft_dir),
            "prompt_source": source, "prompts": len(prompts), "max_new_tokens": max_new_tokens, **extra,
            "target_dtype": str(engine.target.lm_head.weight.dtype).removeprefix("torch."),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def calibrate_policy(engine, prompts: Sequence, max_new_tokens: int = 128, source: str = "user prompts",
                     out_dir: Optional[str] = None, progress: bool = True, chat: bool = True,
                     batch_size: int = 4):
    """Calibrate HeteroSpec for ``engine``'s pair from one set of traces (:func:`collect_traces`):
    the acceptance tables of the fitted policy and the paper's CART bins (TCR label of the
    engine's own tree). With ``out_dir`` both are saved there (``acceptance_tables.json``,
    ``entropy_bins.json``, or ``acceptance_tables_k<top_k>.json``, ``entropy_bins_d<depth>_k<K>.json``
    when the directory holds another tree's: ``tables.path`` and ``bins.path`` say which). Returns
    ``(tables, bins)`` and sets both on the engine."""
    from .policy import AcceptanceTables

    if not prompts:
        raise ValueError("calibrate: no calibration prompts given")
    cfg = engine.config
    traces = collect_traces(engine, prompts, max_new_tokens=max_new_tokens, progress=progress, chat=chat,
                            batch_size=batch_size)
    traces["default_action"] = (cfg.depth, cfg.total_tokens)
    provenance = _tables_provenance(engine, prompts, source, max_new_tokens,
                                    tree={"top_k": cfg.top_k, "depth": cfg.depth, "total_tokens": cfg.total_tokens,
                                          "pstar_pool": cfg.pstar_pool})
    tables = fit_tables(traces, provenance=provenance)
    x = traces["entropy"][(cfg.depth, cfg.resolved_entropy_k)] if (cfg.depth, cfg.resolved_entropy_k) in \
        traces["entropy"] else None
    bins = None
    if x is not None:
        bprov = dict(provenance, label="tcr", rounds=int(len(x)),
                     tree=dict(provenance["tree"], entropy_k=cfg.resolved_entropy_k))
        bins = fit_bins(x, traces["tcr"], provenance=bprov)
        bins.provenance["rank_rises_with_entropy"] = rank_rises_with_entropy(bins)
        engine.bins = bins
    if out_dir is not None:
        # One directory holds the calibrations of several trees (the CPU's and the GPU's):
        # acceptance_tables[_k<top_k>].json, entropy_bins[_d<depth>_k<K>].json.
        os.makedirs(out_dir, exist_ok=True)
        tables.path = AcceptanceTables.path_to_write(out_dir, cfg.top_k)
        if bins is not None:
            bins.path = bins_path_to_write(out_dir, cfg)
        tables.save(tables.path)
        if bins is not None:
            bins.save(bins.path)
    engine.tables = tables
    return tables, bins


# ---------------------------------------------------------------------------------------------
# Held-out check of the tables: what their plans accept on prompts they were not fitted on
# ---------------------------------------------------------------------------------------------
def measure_held_out(engine, tables, prompts: Sequence, max_new_tokens: int = 128, source: str = "user prompts",
                     progress: bool = True, chat: bool = True) -> dict:
    """Decode ``prompts`` with every round the fitted policy's speculative plan (no context
    lookup) and return, per draft position ``j = 1..``, observed / predicted ``P(accepted >= j)``
    of ``tables`` (:attr:`heterospec.policy.AcceptanceTables.held_out`): the ratio a fresh workload's
    online correction starts from. Positions the plans predicted fewer than ``MIN_OBSERVED``
    acceptances for are left out. The prompts must not be the calibration prompts (the point is
    prompts the tables were not fitted on)."""
    import dataclasses

    from tqdm.auto import tqdm

    from .policy import ForcedPolicy

    if not prompts:
        raise ValueError("measure_held_out: no held-out prompts given")
    cfg = engine.config
    if tables.top_k != cfg.top_k:
        raise ValueError(f"measure_held_out: the tables were measured with tree top_k {tables.top_k}, "
                         f"the engine drafts with top_k {cfg.top_k}")
    # The tables as fitted (no earlier held-out start), every round speculative, sums never forgotten.
    policy = ForcedPolicy(dataclasses.replace(tables, held_out=None), engine.cost_model, cfg, speculate=True,
                          ragged=engine.ragged_verify)
    policy.FORGET = 1.0
    for p in tqdm(prompts, desc="held-out check", disable=not progress, unit="prompt"):
        engine.generate(p, max_new_tokens=max_new_tokens, method="heterospec", policy=policy, lookup=False,
                        corpus=False, chat=chat)
    scale, predicted = [], []
    for obs, pred in zip(policy._pos_obs, policy._pos_pred):
        if pred < policy.MIN_OBSERVED:
            break
        scale.append(round(obs / pred, 4))
        predicted.append(round(pred, 1))
    if not scale:
        raise ValueError(f"measure_held_out: the plans predicted fewer than {policy.MIN_OBSERVED} acceptances "
                         f"over {len(prompts)} prompts: too few prompts or tokens to measure")
    return {"position_scale": scale, "predicted": predicted, "prompt_source": source, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "cost_model": getattr(engine.cost_model, "stamp", None),
            "target_dtype": str(engine.target.lm_head.weight.dtype).removeprefix("torch."),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


# ---------------------------------------------------------------------------------------------
# Lookup prior: how often chains copied from the context, earlier requests and the lookup
# corpus are accepted, for a fresh lookup gate to start from
# ---------------------------------------------------------------------------------------------
def measure_lookup_prior(engine, prompts: Sequence, max_new_tokens: int = 128, source: str = "user prompts",
                         progress: bool = True, chat: bool = True) -> dict:
    """Decode ``prompts`` greedily (autoregressive: the target's own tokens) and replay every step
    of each as the lookup gate would see it: the chain each source proposes there - the request's
    own context (:class:`~heterospec.lookup.ContextIndex`), the earlier prompts' requests
    (:class:`~heterospec.lookup.OutputHistory`, as ``engine.lookup_history`` and the vLLM plugin
    keep them) and the engine's lookup corpus where the own match is shorter than
    :data:`~heterospec.lookup.CORPUS_BELOW` - against the tokens the target went on to emit.
    Counted as :meth:`LookupGate.observe` counts a verified chain: per gate row and position,
    tokens verified (their predecessors accepted) and accepted. Every source's chain counts, not
    only the one a gate would pick: the prior is each row's own acceptance. Greedy: a sampled
    target accepts less. Returns :data:`~heterospec.lookup.LOOKUP_PRIOR_FILE`'s content."""
    from tqdm.auto import tqdm

    from .lookup import (CORPUS_BELOW, CORPUS_SOURCE, LOOKUP_KMAX, LOOKUP_PRIOR_FORMAT, MATCH_BUCKETS, SOURCES,
                         ContextIndex, OutputHistory, proposal_row)

    if not prompts:
        raise ValueError("measure_lookup_prior: no prompts given")
    K = LOOKUP_KMAX
    rows = len(MATCH_BUCKETS) * len(SOURCES)
    tried, hit = [[0] * K for _ in range(rows)], [[0] * K for _ in range(rows)]
    history, corpus = OutputHistory(), engine.lookup_corpus
    for p in tqdm(prompts, desc="lookup prior", disable=not progress, unit="prompt"):
        ids = engine._encode(p, chat)
        out = engine.generate(ids, max_new_tokens=max_new_tokens, method="autoregressive", chat=False).token_ids
        index, key = ContextIndex(ids), OutputHistory.key(ids)
        for t in range(len(out)):
            index.extend(out[t:t + 1])              # the step after out[t]: it continues out[t + 1:]
            ahead = out[t + 1:]
            if not ahead:
                break
            own = index.propose(K)
            proposals = [own, (*history.propose(index.tokens, K, prompt_key=key), True)]
            if corpus is not None and own[1] < CORPUS_BELOW:
                proposals.append((*corpus.propose(index.tokens, K), CORPUS_SOURCE))
            for prop in proposals:
                chain = prop[0][:len(ahead)]        # (the output's end: what is left of it to compare)
                if not chain:
                    continue
                row, a = proposal_row(prop), 0
                while a < len(chain) and chain[a] == ahead[a]:
                    a += 1
                for j in range(min(a + 1, len(chain))):
                    tried[row][j] += 1
                    hit[row][j] += int(j < a)
        history.add(ids, out)
    vocab = getattr(getattr(engine.target, "config", None), "vocab_size", None)
    return {"format": LOOKUP_PRIOR_FORMAT, "kmax": K, "buckets": list(MATCH_BUCKETS), "sources": list(SOURCES),
            "tried": tried, "hit": hit, "prompt_source": source, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "temperature": 0.0, "vocab_size": vocab,
            "corpus": corpus is not None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def save_lookup_prior(prior: dict, out_dir: str) -> str:
    """Write a lookup prior (:func:`measure_lookup_prior`) as ``out_dir``/lookup_prior.json (checked
    first); returns the path."""
    from ._io import write_json_atomic
    from .lookup import LOOKUP_PRIOR_FILE, check_lookup_prior

    check_lookup_prior(prior)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, LOOKUP_PRIOR_FILE)
    write_json_atomic(path, prior, indent=1)
    return path


# ---------------------------------------------------------------------------------------------
# Chain tables: the same traces for engines that draft a chain (vLLM's EAGLE-3 proposer)
# ---------------------------------------------------------------------------------------------
CHAIN_ENTROPY_KS = (4, 8)


def calibrate_chain_tables(engine, prompts: Sequence, max_new_tokens: int = 128, max_draft_tokens: int = 8,
                           source: str = "user prompts", out_dir: Optional[str] = None,
                           progress: bool = True, chat: bool = True, batch_size: int = 4):
    """Acceptance tables for *chain* drafting (one draft token per forward, top_k = 1), the
    shape of vLLM's EAGLE-3 proposer: per bin of the first draft step's Top-K entropy, the
    expected accepted length of a chain of every length 0 .. ``max_draft_tokens``. ``H`` is read
    after the first draft forward only (``decide_depth`` 0), the one point where vLLM's proposer
    can still choose how many more forwards to run. ``engine`` must be configured with
    ``top_k=1``. With ``out_dir`` the tables are saved as ``acceptance_tables_chain.json``."""
    from .policy import CHAIN_TABLES_FILENAME

    cfg = engine.config
    if cfg.top_k != 1:
        raise ValueError(f"calibrate_chain_tables: the engine must draft a chain (top_k=1), got top_k={cfg.top_k}")
    if not 1 <= max_draft_tokens <= 16:
        raise ValueError(f"calibrate_chain_tables: max_draft_tokens must be in [1, 16], got {max_draft_tokens}")
    if not prompts:
        raise ValueError("calibrate: no calibration prompts given")
    if cfg.depth + 1 > max_draft_tokens or cfg.total_tokens > max_draft_tokens + 1:
        raise ValueError(f"calibrate_chain_tables: the engine's chain (depth {cfg.depth}, {cfg.total_tokens} nodes) "
                         f"must fit max_draft_tokens={max_draft_tokens}")
    depths = list(range(max_draft_tokens))                 # tree forwards after the first: chain of d + 1
    nodes = list(range(1, max_draft_tokens + 2))           # root + up to max_draft_tokens drafts
    traces = collect_traces(engine, prompts, max_new_tokens=max_new_tokens, depths=depths, nodes=nodes,
                            entropy_ks=CHAIN_ENTROPY_KS, batch_size=batch_size, progress=progress, chat=chat,
                            decide_depths=[0])
    traces["default_action"] = (cfg.depth, cfg.total_tokens)
    provenance = _tables_provenance(engine, prompts, source, max_new_tokens, shape="chain",
                                    max_draft_tokens=max_draft_tokens)
    tables = fit_tables(traces, provenance=provenance)
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        tables.save(os.path.join(out_dir, CHAIN_TABLES_FILENAME))
    return tables
