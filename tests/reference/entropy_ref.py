"""References for topk_entropy and entropy_bin_policy (docs/design.md, ops 1 and 3)."""

import math

import torch


def topk_entropy_ref(logits: torch.Tensor, k: int, parent_entropy=None):
    """float64 log-softmax, stable descending sort (ties: lower id), entropy of the renormalised top-k."""
    x = logits.detach().cpu().to(torch.float64)
    M = x.shape[0]
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    top = torch.gather(x, 1, order)
    logz = torch.logsumexp(x, dim=-1, keepdim=True)
    lp = (top - logz).to(torch.float32)
    h = torch.zeros(M, dtype=torch.float64)
    for r in range(M):
        vals = [v for v in top[r].tolist() if v != -math.inf]
        w = [math.exp(v - vals[0]) for v in vals]
        z = sum(w)
        h[r] = -sum((wi / z) * math.log(wi / z) for wi in w if wi > 0)
    if parent_entropy is not None:
        h = h + parent_entropy.detach().cpu().to(torch.float64)
    return lp, order, h.to(torch.float32)


def entropy_bin_policy_ref(path_entropy, bin_edges, bin_extra_depth, bin_budget):
    """bins[b] = #{edges e : h > e}; NaN -> last bin."""
    edges = bin_edges.cpu().tolist()
    bins = []
    for h in path_entropy.cpu().tolist():
        bins.append(len(edges) if math.isnan(h) else sum(1 for e in edges if h > e))
    bins = torch.tensor(bins, dtype=torch.int64)
    return bins, bin_extra_depth.cpu()[bins], bin_budget.cpu()[bins]
