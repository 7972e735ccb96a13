"""For each verified round: rows the greedy walk needs (root + accepted nodes) ranked by effective score."""
import sys, json, torch, heterospec
from heterospec import ops, datasets
import heterospec.engine as E
stash = {}
orig_sel, orig_ver = ops.select_tree_nodes, ops.verify_greedy
def sel(scores, parents, budgets, max_nodes):
    out = orig_sel(scores, parents, budgets, max_nodes)
    stash['s'] = (scores, parents, out)
    return out
recs = []
def ver(tree_tokens, top1, first_child, next_sibling, num_nodes):
    ap, al, bonus = orig_ver(tree_tokens, top1, first_child, next_sibling, num_nodes)
    s = stash.pop('s', None)
    B, T = tree_tokens.shape
    for b in range(B):
        n = int(num_nodes[b]); L = int(al[b])
        path = ap[b, :L + 1].tolist()  # tree positions, root = 0
        if s is not None and s[2][0].shape[1] >= T:
            scores, parents, (cand, tpar, nn) = s
            c = cand[b, :n].tolist()
            # effective score e[c] = min(score, e[parent]); root inf
            sc = scores[b].tolist(); par = parents[b].tolist(); e = {}
            def eff(ci):
                if ci < 0: return float('inf')
                if ci not in e: e[ci] = min(sc[ci], eff(par[ci]))
                return e[ci]
            effs = [eff(ci) for ci in c]
            order = sorted(range(n), key=lambda i: (-effs[i], c[i]))
            rank = {pos: r for r, pos in enumerate(order)}
            need = max(rank[p] for p in path) + 1
            kind = 'tree'
        else:
            need = L + 1  # chain: positions in order
            kind = 'chain'
        recs.append((kind, n, L, need))
    return ap, al, bonus
ops.select_tree_nodes, ops.verify_greedy = sel, ver
E.ops.select_tree_nodes, E.ops.verify_greedy = sel, ver
eng = heterospec.Engine.from_pretrained()
sets = sys.argv[1:] or ['mtbench']
for name in sets:
    for p in datasets.load_prompts(name, n=4):
        eng.generate(p.text, max_new_tokens=128, method='heterospec')
import collections
for kind in ('tree', 'chain'):
    r = [x for x in recs if x[0] == kind]
    if not r: continue
    print(kind, 'rounds', len(r), 'mean nodes %.2f' % (sum(x[1] for x in r)/len(r)), 'mean acc %.2f' % (sum(x[2] for x in r)/len(r)),
          'mean need %.2f' % (sum(x[3] for x in r)/len(r)))
    hist = collections.Counter(x[1] for x in r); print(' nodes hist', sorted(hist.items()))
    for M in range(1, 13):
        print('  M=%d  covered %.3f  mean rows(1-call-then-rest) ' % (M, sum(x[3] <= M for x in r)/len(r)))
json.dump(recs, open('/tmp/s79_paths.json', 'w'))
