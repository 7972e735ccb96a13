"""Offline: in the drafted rounds of a heterospec e2e run, what a request's lookup chain (own
context, else the corpus) would have given instead of the draft's tree, per proposal row.
Greedy outputs are the autoregressive ones (regenerated here); round positions from the records."""
import json, sys, collections, torch, heterospec
from heterospec.bench import load_prompt_sets
from heterospec.lookup import ContextIndex, proposal_row, CORPUS_BELOW, CORPUS_SOURCE
d = json.load(open(sys.argv[1])); dtype = getattr(torch, sys.argv[2]); K = 6
eng = heterospec.Engine.from_pretrained(dtype=dtype)
corpus = eng.lookup_corpus
sets = load_prompt_sets(sorted({r["set"] for r in d["runs"]}), 8)
byid = {q.id: q for ps in sets.values() for q in ps}
stats = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])   # row -> rounds, draft acc, lookup acc, best
total_tokens = 0
for r in d["runs"]:
    if r["method"] != "heterospec": continue
    p = byid[r["prompt_id"]]
    ids = eng._encode(p.text, True)
    out = eng.generate(p.text, max_new_tokens=r["new_tokens"], method="autoregressive").token_ids
    total_tokens += len(out)
    pos = 0
    for rec in r["records"]:
        if not (rec["plain"] or rec["lookup"]):
            ctx = ids + out[:pos]
            idx = ContextIndex(ctx)
            chain, n = idx.propose(K)
            prop = (chain, n)
            if n < CORPUS_BELOW and corpus is not None:
                c, g = corpus.propose(ctx, K)
                if c: prop = (c, g, CORPUS_SOURCE)
            if prop[0]:
                truth = out[pos:pos + K]
                l = 0
                while l < len(prop[0]) and l < len(truth) and prop[0][l] == truth[l]: l += 1
                row = proposal_row(prop)
                s = stats[row]; s[0] += 1; s[1] += rec["accept_len"]; s[2] += l; s[3] += max(l, rec["accept_len"])
        pos += rec["accept_len"] + 1
print(f"{total_tokens} tokens; per row: rounds, mean draft accepted, mean lookup accepted, gain if always substituted (tokens)")
for row in sorted(stats):
    n, a, l, b = stats[row]
    print(f"row {row:2d}: {n:4d} rounds  draft {a/n:.2f}  lookup {l/n:.2f}  substitute-gain {l-a:+.0f}  oracle-gain {b-a:+.0f}")
