"""References for select_tree_nodes, build_tree, tree_attention_mask, dense_tree_attention_mask."""

import math

import torch


def select_tree_nodes_ref(scores, parents, budgets, max_nodes: int):
    scores, parents, budgets = scores.cpu(), parents.cpu(), budgets.cpu()
    B, C = scores.shape
    T = max_nodes + 1
    tree_cand = torch.full((B, T), -1, dtype=torch.int64)
    tree_parents = torch.full((B, T), -1, dtype=torch.int64)
    num_nodes = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        s, par = scores[b].tolist(), parents[b].tolist()
        eff = []
        for c in range(C):
            pe = math.inf if par[c] < 0 else eff[par[c]]
            eff.append(min(s[c], pe))
        valid = [c for c in range(C) if eff[c] > -math.inf]
        ranked = sorted(valid, key=lambda c: (-eff[c], c))
        chosen = sorted(ranked[: min(int(budgets[b]), len(valid))])
        pos = {c: i + 1 for i, c in enumerate(chosen)}
        for i, c in enumerate(chosen):
            tree_cand[b, i + 1] = c
            tree_parents[b, i + 1] = 0 if par[c] < 0 else pos[par[c]]
        num_nodes[b] = 1 + len(chosen)
    return tree_cand, tree_parents, num_nodes


def build_tree_ref(tree_parents, num_nodes, prefix_lens):
    tree_parents, num_nodes, prefix_lens = tree_parents.cpu(), num_nodes.cpu(), prefix_lens.cpu()
    B, T = tree_parents.shape
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    positions = torch.zeros(B, T, dtype=torch.int64)
    first_child = torch.full((B, T), -1, dtype=torch.int64)
    next_sibling = torch.full((B, T), -1, dtype=torch.int64)
    for b in range(B):
        n, L = int(num_nodes[b]), int(prefix_lens[b])
        par = tree_parents[b].tolist()
        for i in range(T):
            if i >= n:
                mask[b, i, i] = True
                positions[b, i] = L
                continue
            depth, j = 0, i
            while j != 0:  # walk up to the root
                mask[b, i, j] = True
                j = par[j]
                depth += 1
            mask[b, i, 0] = True
            positions[b, i] = L + depth
        for i in range(n):
            kids = [c for c in range(1, n) if par[c] == i]
            if kids:
                first_child[b, i] = kids[0]
                for a, c in zip(kids, kids[1:]):
                    next_sibling[b, a] = c
    return mask, positions, first_child, next_sibling


def tree_attention_mask_ref(tree_mask, num_nodes, prefix_lens):
    tree_mask, num_nodes, prefix_lens = tree_mask.cpu(), num_nodes.cpu(), prefix_lens.cpu()
    blocks, indptr = [], [0]
    for b in range(tree_mask.shape[0]):
        n, L = int(num_nodes[b]), int(prefix_lens[b])
        blk = torch.cat([torch.ones(n, L, dtype=torch.bool), tree_mask[b, :n, :n]], dim=1)
        blocks.append(blk.reshape(-1))
        indptr.append(indptr[-1] + n * (L + n))
    flat = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)
    return flat, torch.tensor(indptr, dtype=torch.int64)


def dense_tree_attention_mask_ref(tree_mask, prefix_lens, width: int):
    tree_mask, prefix_lens = tree_mask.cpu(), prefix_lens.cpu()
    B, T, _ = tree_mask.shape
    out = torch.zeros(B, T, width, dtype=torch.bool)
    for b in range(B):
        L = int(prefix_lens[b])
        out[b, :, :L] = True
        out[b, :, L : L + T] = tree_mask[b]
    return out
