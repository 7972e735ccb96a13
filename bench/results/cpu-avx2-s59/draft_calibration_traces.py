"""Per drafted candidate: layer, own draft log-prob, cumulative score, reached (target greedy path)."""
import sys, math, pickle, numpy as np, torch
from tqdm import tqdm
from heterospec import Engine, ops
from heterospec.config import SamplingParams
from heterospec.policy import Plan
from heterospec.calibrate import _layer_of
from heterospec.datasets import load_prompts
from heterospec.train.prompts import calibration_prompts
torch.set_num_threads(2)
eng = Engine.from_pretrained()
cfg = eng.config; k = cfg.top_k; D = 4; C = k + D * k * k
which = sys.argv[1]
if which == "calib":
    prompts = calibration_prompts(n=32)[0]
else:
    prompts = [p.text for s in ("mtbench", "alpaca", "gsm", "humaneval", "cnndm") for p in load_prompts(s, n=4)]
plan = Plan("trace", decide_depth=D, entropy_k=k, edges=[], depth=[D], budget=[C], binned=False)
params = SamplingParams()
rec = []
enc = [eng._encode(p, True) for p in prompts]
with torch.inference_mode():
    for start in tqdm(range(0, len(enc), 4)):
        ids = enc[start:start + 4]
        cache_len = max(len(p) for p in ids) + 96 + 2 * C + 2
        st = eng._prefill(ids, "heterospec", params, None, cache_len, 96, None, True)
        while st.active():
            active = st.active()
            tree = eng._draft_tree(st, cfg, plan)
            tree.budget = torch.full((st.size,), C, dtype=torch.int64)
            verdict = eng._verify(st, tree, Plan("trace", decide_depth=0, entropy_k=k, edges=[], depth=[0], budget=[C], binned=False), params, None)
            cand = verdict.tree_cand.tolist(); top1 = verdict.target_top1.tolist()
            toks = tree.tokens.tolist(); par = tree.parents.tolist()
            sc = tree.scores.tolist(); loc = tree.local.tolist()
            for b in active:
                pos_of = {c: p for p, c in enumerate(cand[b]) if c >= 0}
                reached = {}
                rows = []
                for c in range(C):
                    if c not in pos_of or not math.isfinite(sc[b][c]):
                        continue
                    p = par[b][c]
                    pr = True if p < 0 else reached.get(p, False)
                    ppos = 0 if p < 0 else pos_of.get(p)
                    r = pr and ppos is not None and top1[b][ppos] == toks[b][c]
                    reached[c] = r
                    rows.append((c, p, sc[b][c], loc[b][c], pr, r))
                rec.append((start + b, rows))
            eng._commit(st, tree, verdict, 96, None, 0.0, 0.0)
pickle.dump({"rec": rec, "k": k, "C": C}, open(f"/tmp/s59/diag_{which}.pkl", "wb"))
print("rounds", len(rec))
