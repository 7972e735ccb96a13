"""How the shipped lookup corpus's free chains scale with its size: random document subsets
(1/16 .. 1) of lookup_corpus.npz, proposals at every position of the target's greedy answers
on the five benchmark sets (refs.json: 10 prompts a set x 128 tokens), accepted = the chain's
longest prefix equal to what the target wrote next. Measurement only."""
import json, os, collections
import numpy as np
import heterospec  # noqa: F401  (loads the ops)
from heterospec.datastore import CorpusIndex, SEP, CORPUS_FILE
from heterospec.defaults import default_draft_dir

K = 8
refs = json.load(open(os.path.join(os.path.dirname(__file__), "refs.json")))
full = CorpusIndex.load(os.path.join(default_draft_dir(), CORPUS_FILE)).tokens()
cuts = np.flatnonzero(full == SEP)
docs = np.split(full, cuts + 1)
docs = [d for d in docs if len(d)]
rng = np.random.default_rng(0)
perm = rng.permutation(len(docs))
print(f"corpus {len(full):,} tokens, {len(docs):,} documents")
rows = []
for frac in (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0):
    pick = np.sort(perm[:max(1, int(round(frac * len(docs))))])
    toks = np.concatenate([docs[i] for i in pick])
    idx = CorpusIndex(toks)
    by_grade = collections.defaultdict(lambda: [0, 0])
    per_set = collections.defaultdict(lambda: [0, 0])
    set_positions = collections.Counter()
    positions = 0
    for r in refs:
        ctx, out = list(r["prompt"]), r["output"]
        set_positions[r["set"]] += len(out)
        for i in range(len(out)):
            positions += 1
            chain, grade = idx.propose(ctx + out[:i], K)
            if chain:
                acc = 0
                for a, b in zip(chain, out[i:]):
                    if a != b:
                        break
                    acc += 1
                by_grade[grade][0] += 1; by_grade[grade][1] += acc
                per_set[r["set"]][0] += 1; per_set[r["set"]][1] += acc
    props = sum(v[0] for v in by_grade.values()); acc = sum(v[1] for v in by_grade.values())
    g45 = [by_grade[g] for g in (4, 5)]
    row = {"fraction": frac, "tokens": int(len(toks)), "positions": positions, "proposed": props,
           "accepted_per_proposal": acc / max(props, 1), "accepted_per_position": acc / positions,
           "grade45_proposed": sum(p for p, _ in g45),
           "grade45_accepted_per_proposal": sum(a for _, a in g45) / max(sum(p for p, _ in g45), 1),
           "by_grade": {g: [p, a / max(p, 1)] for g, (p, a) in sorted(by_grade.items())},
           "per_set_accepted_per_position": {s: per_set[s][1] / n for s, n in set_positions.items()}}
    rows.append(row)
    print(f"{frac:6.4f} {len(toks):>9,} tok: proposed {props / positions:.3f} of positions, "
          f"{row['accepted_per_proposal']:.3f} tok/proposal, {row['accepted_per_position']:.3f} tok/position; "
          f"grade 4-5: {row['grade45_proposed'] / positions:.3f} of positions, {row['grade45_accepted_per_proposal']:.3f} tok/proposal",
          flush=True)
json.dump(rows, open(os.path.join(os.path.dirname(__file__), "corpus_scale.json"), "w"), indent=1)

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(6, 4))
xs = [r["tokens"] for r in rows]
ax.plot(xs, [r["accepted_per_position"] for r in rows], "ko-", lw=2, label="all five sets")
for s in rows[0]["per_set_accepted_per_position"]:
    ax.plot(xs, [r["per_set_accepted_per_position"][s] for r in rows], "o--", label=s)
ax.set_xscale("log", base=2)
ax.set_xlabel("lookup corpus size (tokens; random document subsets)")
ax.set_ylabel("corpus chain tokens accepted per answer position")
ax.set_title("Free chains from the target's own answers vs corpus size", fontsize=9)
ax.grid(alpha=0.3)
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(os.path.join(os.path.dirname(__file__), "corpus_scale.png"), dpi=120)
