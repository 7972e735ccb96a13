"""Per plugin engine of a traced vllm_compare run: steps by the longest draft of the step
(-1 plain, 0 a speculative step whose bins drafted nothing), their mean accepted drafts,
P(accepted >= j), mean milliseconds (target + draft + warm forward + our Python) and tokens per ms.

    python chain_kinds.py trace.jsonl.gz [batch]
"""
import collections
import gzip
import json
import statistics as S
import sys

recs = [json.loads(line) for line in gzip.open(sys.argv[1], "rt")]
B = int(sys.argv[2]) if len(sys.argv) > 2 else 1
by = collections.defaultdict(list)
for r in recs:
    by[r["pid"]].append(r)
for pid, x in by.items():
    label = "new (speed kept)" if "speed" in x[0] else "baseline"
    y = [r for r in x if r["batch"] == B and r["target_ms"] is not None and r["max_query_len"] <= 7
         and r["target_ms"] < 1000]
    groups = collections.defaultdict(list)
    for r in y:
        groups[max(r["k"]) if r["k"] else -1].append(r)
    tok_all = ms_all = 0.0
    for k in sorted(groups):
        z = groups[k]
        acc = [(k - sum(r["rejected"])) if k > 0 else 0 for r in z]
        ms = [r["target_ms"] + r["draft_ms"] + r["warm_ms"] + r["ours_ms"] for r in z]
        tok = B * len(z) + sum(acc) if B == 1 else sum(B + (sum(r["k"]) - sum(r["rejected"]) if r["k"] else 0) for r in z)
        tok_all, ms_all = tok_all + tok, ms_all + sum(ms)
        print(f"{pid} {label} k={k:2d} steps {len(z):5d} accepted {S.mean(acc):.2f} "
              f"P(acc>=j) {[round(sum(a >= j for a in acc) / len(acc), 2) for j in range(1, k + 1)]} "
              f"ms {S.mean(ms):.1f} (target {S.mean(r['target_ms'] for r in z):.1f}, draft "
              f"{S.mean(r['draft_ms'] for r in z):.1f}, ours {S.mean(r['ours_ms'] for r in z):.2f}) "
              f"tokens/ms {tok / sum(ms):.4f}")
    print(f"{pid} {label} all: {len(y)} steps, {tok_all / ms_all:.4f} tokens/ms")
