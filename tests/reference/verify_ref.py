"""References for verify_greedy and verify_sampling (docs/design.md, ops 7 and 8)."""

import torch


def _children(first_child, next_sibling, b, i):
    out, c = [], int(first_child[b, i])
    while c != -1:
        out.append(c)
        c = int(next_sibling[b, c])
    return out


def verify_greedy_ref(tree_tokens, target_ids, first_child, next_sibling, num_nodes):
    tree_tokens, target_ids = tree_tokens.cpu(), target_ids.cpu()
    first_child, next_sibling = first_child.cpu(), next_sibling.cpu()
    B, T = tree_tokens.shape
    path = torch.full((B, T), -1, dtype=torch.int64)
    alen = torch.zeros(B, dtype=torch.int64)
    bonus = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        cur, acc = 0, [0]
        while True:
            nxt = [c for c in _children(first_child, next_sibling, b, cur) if tree_tokens[b, c] == target_ids[b, cur]]
            if not nxt:
                break
            cur = nxt[0]
            acc.append(cur)
        path[b, : len(acc)] = torch.tensor(acc)
        alen[b] = len(acc) - 1
        bonus[b] = target_ids[b, cur]
    return path, alen, bonus


def sample_residual(p, exclude, coin):
    """Inverse CDF over p with the tokens in `exclude` zeroed (falls back to the full p)."""
    p = p.to(torch.float64).clone()
    q = p.clone()
    for x in exclude:
        q[x] = 0.0
    if not float(q.sum()) > 0:
        q = p
    cum = torch.cumsum(q, 0)
    hits = (cum > coin * float(q.sum())) & (q > 0)
    if bool(hits.any()):
        return int(hits.nonzero()[0, 0])
    return int((q > 0).nonzero()[-1, 0])


def verify_sampling_ref(tree_tokens, target_probs, first_child, next_sibling, num_nodes, coins, final_coins,
                        *, zero_children_in_residual=True):
    """The lossless rule. `zero_children_in_residual=False` is a deliberately BIASED variant
    (bonus drawn from the full p after a rejection), used as the statistical test's negative control."""
    tree_tokens, target_probs = tree_tokens.cpu(), target_probs.cpu()
    first_child, next_sibling = first_child.cpu(), next_sibling.cpu()
    coins, final_coins = coins.cpu(), final_coins.cpu()
    B, T = tree_tokens.shape
    path = torch.full((B, T), -1, dtype=torch.int64)
    alen = torch.zeros(B, dtype=torch.int64)
    bonus = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        cur, acc = 0, [0]
        while True:
            p = target_probs[b, cur].to(torch.float64)
            total = float(p.sum())
            u = float(coins[b, cur]) * total
            seen, s, nxt = [], 0.0, None
            for c in _children(first_child, next_sibling, b, cur):
                x = int(tree_tokens[b, c])
                if x in seen:
                    continue
                seen.append(x)
                s += float(p[x])
                if u < s:
                    nxt = c
                    break
            if nxt is None:
                bonus[b] = sample_residual(p, seen if zero_children_in_residual else [], float(final_coins[b]))
                break
            cur = nxt
            acc.append(cur)
        path[b, : len(acc)] = torch.tensor(acc)
        alen[b] = len(acc) - 1
    return path, alen, bonus
