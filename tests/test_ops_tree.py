"""select_tree_nodes, build_tree, tree_attention_mask, dense_tree_attention_mask vs the references."""

import math

import pytest
import torch

import heterospec.ops as ops
from reference import (
    build_tree_ref,
    dense_tree_attention_mask_ref,
    select_tree_nodes_ref,
    tree_attention_mask_ref,
)
from reference.samples import golden_two_request_tree, random_candidates, random_tree, strided


def _assert_all_equal(out, ref):
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype, (o.dtype, r.dtype)
        assert torch.equal(o.cpu(), r), (o, r)


# ---------------------------------------------------------------- select_tree_nodes
@pytest.mark.parametrize("mode", ["monotone", "random", "ties"])
@pytest.mark.parametrize("B,C,max_nodes", [(1, 1, 0), (1, 1, 1), (1, 5, 3), (3, 20, 8), (16, 40, 16), (2, 200, 127)])
def test_select_tree_nodes_random(devices, mode, B, C, max_nodes):
    g = torch.Generator().manual_seed(B * 1000 + C)
    scores, parents = random_candidates(B, C, mode=mode, gen=g)
    budgets = torch.randint(0, max_nodes + 1, (B,), generator=g)
    budgets[0] = max_nodes
    out = ops.select_tree_nodes(scores.to(devices), parents.to(devices), budgets.to(devices), max_nodes)
    ref = select_tree_nodes_ref(scores, parents, budgets, max_nodes)
    _assert_all_equal(out, ref)
    # Closed under ancestors: every selected node's parent position is earlier and real.
    tree_parents, num_nodes = out[1].cpu(), out[2].cpu()
    for b in range(B):
        for i in range(1, int(num_nodes[b])):
            assert 0 <= tree_parents[b, i] < i


def test_select_tree_nodes_noncontiguous(devices):
    scores, parents = random_candidates(6, 30, mode="random")
    scores_t = scores.t().contiguous().t()  # same values, column-major
    budgets = torch.tensor([3, 0, 10, 29, 5, 1])
    out = ops.select_tree_nodes(scores_t.to(devices), parents.to(devices), budgets.to(devices), 30)
    _assert_all_equal(out, select_tree_nodes_ref(scores, parents, budgets, 30))


def test_select_tree_nodes_golden(devices):
    ninf = -math.inf
    # request 0: candidates 0,1 children of the root; 2,3 children of 0; 4 child of 1; 5 invalid.
    #   effective: [-1, -2, -1.5, -3, -2 (min(-0.5, -2)), -inf]  -> budget 3: {0, 2, then 1 vs 4 tie -> 1}
    # request 1: a tie on equal scores is broken by the lower index; 3's parent is invalid.
    scores = torch.tensor([[-1.0, -2.0, -1.5, -3.0, -0.5, ninf], [-1.0, -1.0, ninf, -0.1, -1.0, -1.0]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 4], [-1, -1, -1, 2, 0, 1]])
    budgets = torch.tensor([3, 4])
    cand, par, n = ops.select_tree_nodes(scores.to(devices), parents.to(devices), budgets.to(devices), 4)
    assert cand.cpu().tolist() == [[-1, 0, 1, 2, -1], [-1, 0, 1, 4, 5]]
    assert par.cpu().tolist() == [[-1, 0, 0, 1, -1], [-1, 0, 0, 1, 2]]
    assert n.cpu().tolist() == [4, 5]


def test_select_tree_nodes_empty(devices):
    out = ops.select_tree_nodes(torch.empty(2, 0, device=devices), torch.empty(2, 0, dtype=torch.int64, device=devices),
                                torch.tensor([3, 0], device=devices), 4)
    assert out[0].cpu().tolist() == [[-1] * 5] * 2 and out[2].cpu().tolist() == [1, 1]
    out = ops.select_tree_nodes(torch.empty(0, 4, device=devices), torch.empty(0, 4, dtype=torch.int64, device=devices),
                                torch.empty(0, dtype=torch.int64, device=devices), 2)
    assert out[0].shape == (0, 3) and out[2].shape == (0,)


# ---------------------------------------------------------------- build_tree
@pytest.mark.parametrize("B,T", [(1, 1), (1, 2), (2, 5), (4, 16), (16, 33), (3, 128)])
def test_build_tree_random(devices, B, T):
    g = torch.Generator().manual_seed(B * 100 + T)
    parents, num_nodes = random_tree(B, T, gen=g)
    prefix_lens = torch.randint(0, 50, (B,), generator=g)
    out = ops.build_tree(parents.to(devices), num_nodes.to(devices), prefix_lens.to(devices))
    _assert_all_equal(out, build_tree_ref(parents, num_nodes, prefix_lens))


def test_build_tree_noncontiguous(devices):
    g = torch.Generator().manual_seed(9)
    parents, num_nodes = random_tree(4, 21, gen=g)
    prefix_lens = torch.randint(0, 30, (4,), generator=g)
    out = ops.build_tree(*[strided(t.to(devices)) for t in (parents, num_nodes, prefix_lens)])
    _assert_all_equal(out, build_tree_ref(parents, num_nodes, prefix_lens))


def test_build_tree_from_selection(devices):
    scores, parents = random_candidates(8, 60, mode="monotone")
    budgets = torch.randint(0, 25, (8,))
    _, tree_parents, num_nodes = ops.select_tree_nodes(scores, parents, budgets, 24)
    prefix_lens = torch.arange(8) * 7
    out = ops.build_tree(tree_parents.to(devices), num_nodes.to(devices), prefix_lens.to(devices))
    _assert_all_equal(out, build_tree_ref(tree_parents, num_nodes, prefix_lens))


def test_build_tree_golden(devices):
    tree_parents, num_nodes, prefix_lens = golden_two_request_tree()
    mask, pos, fc, ns = ops.build_tree(tree_parents.to(devices), num_nodes.to(devices), prefix_lens.to(devices))
    m0 = [[1, 0, 0, 0, 0, 0],
          [1, 1, 0, 0, 0, 0],
          [1, 0, 1, 0, 0, 0],
          [1, 1, 0, 1, 0, 0],
          [1, 1, 0, 0, 1, 0],
          [0, 0, 0, 0, 0, 1]]
    m1 = [[1, 0, 0, 0, 0, 0],
          [1, 1, 0, 0, 0, 0],
          [1, 1, 1, 0, 0, 0],
          [0, 0, 0, 1, 0, 0],
          [0, 0, 0, 0, 1, 0],
          [0, 0, 0, 0, 0, 1]]
    assert mask.cpu().int().tolist() == [m0, m1]
    assert pos.cpu().tolist() == [[2, 3, 3, 4, 4, 2], [0, 1, 2, 0, 0, 0]]
    assert fc.cpu().tolist() == [[1, 3, -1, -1, -1, -1], [1, 2, -1, -1, -1, -1]]
    assert ns.cpu().tolist() == [[-1, 2, -1, 4, -1, -1], [-1, -1, -1, -1, -1, -1]]


# ---------------------------------------------------------------- attention masks
@pytest.mark.parametrize("B,T", [(1, 1), (2, 6), (5, 17), (16, 9), (2, 128)])
def test_tree_attention_mask_random(devices, B, T):
    g = torch.Generator().manual_seed(B + T)
    parents, num_nodes = random_tree(B, T, gen=g)
    prefix_lens = torch.randint(0, 40, (B,), generator=g)
    prefix_lens[0] = 0
    tree_mask = build_tree_ref(parents, num_nodes, prefix_lens)[0]
    numel = int((num_nodes * (prefix_lens + num_nodes)).sum())
    out = ops.tree_attention_mask(tree_mask.to(devices), num_nodes.to(devices), prefix_lens.to(devices), numel)
    _assert_all_equal(out, tree_attention_mask_ref(tree_mask, num_nodes, prefix_lens))
    width = int(prefix_lens.max()) + T + 3
    dense = ops.dense_tree_attention_mask(tree_mask.to(devices), prefix_lens.to(devices), width)
    assert dense.dtype == torch.bool
    assert torch.equal(dense.cpu(), dense_tree_attention_mask_ref(tree_mask, prefix_lens, width))


def test_attention_masks_noncontiguous(devices):
    parents, num_nodes = random_tree(3, 8)
    prefix_lens = torch.tensor([1, 0, 4])
    tree_mask = build_tree_ref(parents, num_nodes, prefix_lens)[0]
    tm_nc = tree_mask.transpose(1, 2).contiguous().transpose(1, 2)
    numel = int((num_nodes * (prefix_lens + num_nodes)).sum())
    out = ops.tree_attention_mask(tm_nc.to(devices), num_nodes.to(devices), prefix_lens.to(devices), numel)
    _assert_all_equal(out, tree_attention_mask_ref(tree_mask, num_nodes, prefix_lens))
    dense = ops.dense_tree_attention_mask(tm_nc.to(devices), prefix_lens.to(devices), 12)
    assert torch.equal(dense.cpu(), dense_tree_attention_mask_ref(tree_mask, prefix_lens, 12))


def test_attention_masks_golden(devices):
    tree_parents, num_nodes, prefix_lens = golden_two_request_tree()
    tree_mask = build_tree_ref(tree_parents, num_nodes, prefix_lens)[0]
    # request 0: n=5, L=2 -> 5 x 7 block; request 1: n=3, L=0 -> 3 x 3 block.
    custom, indptr = ops.tree_attention_mask(tree_mask.to(devices), num_nodes.to(devices), prefix_lens.to(devices),
                                             5 * 7 + 3 * 3)
    assert indptr.cpu().tolist() == [0, 35, 44]
    blk0 = [[1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 0, 1, 0, 0],
            [1, 1, 1, 1, 0, 1, 0],
            [1, 1, 1, 1, 0, 0, 1]]
    blk1 = [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    flat = custom.cpu().int().tolist()
    assert flat[:35] == sum(blk0, []) and flat[35:] == sum(blk1, [])
    dense = ops.dense_tree_attention_mask(tree_mask.to(devices), prefix_lens.to(devices), 9).cpu().int().tolist()
    assert dense[0][3] == [1, 1, 1, 1, 0, 1, 0, 0, 0]
    assert dense[0][5] == [1, 1, 0, 0, 0, 0, 0, 1, 0]  # padding row: itself only (after the prefix)
    assert dense[1][2] == [1, 1, 1, 0, 0, 0, 0, 0, 0]
