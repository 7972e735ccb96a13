"""The draft's streamed layer as one op (models.draft.LAYER_OP) on against off: a round's draft
work after a target step (extend over 2 tokens + head, then 2 tree steps of 4 nodes + heads),
in-process, alternated; then end to end (eagle3 and heterospec, 6 prompts x 128 tokens, the flag
switched per prompt; the same tokens)."""
import time, sys
import torch
from heterospec import Engine
import heterospec.models.draft as DM
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt, d = eng.target, eng.draft
ctx = 256
with torch.inference_mode():
    cache = tgt.new_cache(1, ctx + 400)
    tgt(torch.randint(0, 49152, (1, ctx)), torch.arange(ctx)[None], cache, torch.zeros(1, dtype=torch.int64), None, None,
        return_features=False)
    dcache = d.new_cache(1, 700)
    feats = torch.randn(1, 300, 3 * 576); ids = torch.randint(0, 49152, (1, 300))
    d.extend(ids[:, :200], feats[:, :200], dcache, torch.zeros(1, dtype=torch.long), torch.tensor([200]))
    prefix = torch.full((1,), ctx, dtype=torch.int64)
    dpl = torch.tensor([200])
    toks = torch.randint(0, 49152, (1, 1))
    res = {}
    for r in range(40):
        for arm in (False, True):
            DM.LAYER_OP = arm
            tgt(toks, prefix[:, None], cache, prefix, None, None, return_features=True, taps=eng._taps)
            t0 = time.perf_counter()
            h = d.extend(ids[:, :2], feats[:, :2], dcache, dpl, torch.tensor([2]))
            d.logits(h[:, -1:])
            t1 = time.perf_counter()
            state = d.new_tree(1)
            hid = h[:, -1:].expand(1, 4, -1)
            par = torch.full((1, 4), -1)
            for depth in range(2):
                layer = d.tree_step(torch.randint(0, 49152, (1, 4)), hid, par, dpl[:, None] + 1 + depth + torch.zeros(1, 4, dtype=torch.long),
                                    dcache, dpl + 2, state, None)
                d.logits(layer)
                par = state.num_nodes - 4 + torch.arange(4)[None]
                hid = layer
            t2 = time.perf_counter()
            res.setdefault((arm, "extend+head"), []).append(t1 - t0); res.setdefault((arm, "2 tree steps+heads"), []).append(t2 - t1)
    for what in ("extend+head", "2 tree steps+heads"):
        off, on = sorted(res[(False, what)]), sorted(res[(True, what)])
        print("%-20s call by call: min %.3f med %.3f ms; one op: min %.3f med %.3f ms (median %.3fx)" % (
            what, off[0] * 1e3, off[20] * 1e3, on[0] * 1e3, on[20] * 1e3, on[20] / off[20]))
prompts = [p.text for s in ("mtbench", "humaneval", "gsm") for p in load_prompts(s, n=2)]
methods = ("eagle3", "heterospec")
eng.generate(prompts[0], max_new_tokens=8)
tot = {(a, m): [0.0, 0, 0.0, 0] for a in (False, True) for m in methods}
ref = {}
for i, p in enumerate(prompts):
    for a in ((False, True) if i % 2 == 0 else (True, False)):
        DM.LAYER_OP = a
        for m in methods:
            r = eng.generate(p, max_new_tokens=128, method=m)
            t = tot[(a, m)]
            t[0] += r.stats.total_s; t[1] += r.stats.new_tokens
            t[2] += sum(x.draft_s for x in r.stats.records); t[3] += sum(1 for x in r.stats.records if x.draft_s > 0)
            if (i, m) in ref: assert ref[(i, m)] == r.token_ids, ("output differs", a, m, i)
            ref[(i, m)] = r.token_ids
for m in methods:
    off, on = tot[(False, m)], tot[(True, m)]
    print("%-11s call by call %.1f tok/s (draft %.2f ms/drafted round)  one op %.1f tok/s (draft %.2f ms)  %.3fx" % (
        m, off[1] / off[0], 1e3 * off[2] / max(off[3], 1), on[1] / on[0], 1e3 * on[2] / max(on[3], 1), (on[1] / on[0]) / (off[1] / off[0])))
print("same tokens in both arms: yes")
