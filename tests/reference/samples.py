"""Random input generators shared by the op tests and the benchmarks."""

import math
import random

import torch


def random_candidates(B: int, C: int, *, mode: str = "monotone", p_neg_inf: float = 0.1, gen=None):
    """Draft candidates recorded layer by layer: scores [B, C] float32, parents [B, C] int64.

    mode: "monotone" (score = parent score + log-prob, as the engine does), "random" (arbitrary
    scores, exercises the min() rule) or "ties" (few distinct integer scores).
    """
    g = gen or torch.Generator().manual_seed(0)
    parents = torch.full((B, C), -1, dtype=torch.int64)
    scores = torch.empty(B, C, dtype=torch.float32)
    for b in range(B):
        for c in range(C):
            p = int(torch.randint(-1, c, (1,), generator=g)) if c > 0 else -1
            parents[b, c] = p
            if mode == "monotone":
                base = 0.0 if p < 0 else float(scores[b, p])
                s = base + math.log(float(torch.rand(1, generator=g)) * 0.999 + 1e-3)
            elif mode == "ties":
                s = float(torch.randint(-3, 1, (1,), generator=g))
            else:
                s = float(torch.randn(1, generator=g)) * 3
            if float(torch.rand(1, generator=g)) < p_neg_inf:
                s = -math.inf
            scores[b, c] = s
    return scores, parents


def random_tree(B: int, T: int, *, gen=None, full: bool = False, junk_padding: bool = True):
    """tree_parents [B, T] (topologically ordered, junk in the padding), num_nodes [B].

    Node counts are random in [1, T], except that the last request of a batch (B >= 2) always
    fills the whole capacity, so every test with a T-node capacity also sees a T-node tree."""
    g = gen or torch.Generator().manual_seed(0)
    parents = torch.full((B, T), -1, dtype=torch.int64)
    num_nodes = torch.empty(B, dtype=torch.int64)
    for b in range(B):
        n = T if full or (B >= 2 and b == B - 1) else int(torch.randint(1, T + 1, (1,), generator=g))
        num_nodes[b] = n
        for i in range(1, T):
            if i < n:
                # Bias towards recent nodes so trees get deep as well as wide.
                lo = max(0, i - 4) if float(torch.rand(1, generator=g)) < 0.5 else 0
                parents[b, i] = int(torch.randint(lo, i, (1,), generator=g))
            elif junk_padding:
                parents[b, i] = int(torch.randint(-5, T + 5, (1,), generator=g))
    return parents, num_nodes


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout: every other element of a twice-as-long
    buffer for vectors, the last two dimensions stored transposed otherwise."""
    if t.dim() == 1:
        buf = torch.empty(2 * t.numel(), dtype=t.dtype, device=t.device)
        out = buf[::2]
        out.copy_(t)
    else:
        out = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not out.is_contiguous() or t.numel() <= 1
    return out


def golden_two_request_tree():
    """A hand-drawn batch of two trees (T = 6), used by several golden tests.

    request 0 (5 nodes):          request 1 (3 nodes, a chain):
        0 (root)                      0 -> 1 -> 2
        |- 1                          positions 3..5 are padding
        |  |- 3
        |  `- 4
        `- 2
    """
    tree_parents = torch.tensor([[-1, 0, 0, 1, 1, -1], [-1, 0, 1, -1, -1, -1]])
    num_nodes = torch.tensor([5, 3])
    prefix_lens = torch.tensor([2, 0])
    return tree_parents, num_nodes, prefix_lens


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
