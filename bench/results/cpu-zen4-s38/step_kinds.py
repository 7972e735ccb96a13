"""Time and tokens per kind of step in a plugin trace (HETEROSPEC_VLLM_TRACE): L lookup, S drafted,
W warm plain, C cold plain; b8 = batch >= 8, b<8 the rest. Steps over a prefill and idle gaps are
left out. Usage: python step_kinds.py DIR/trace.jsonl.gz"""
import collections
import gzip
import json
import sys

recs = [json.loads(line) for line in gzip.open(sys.argv[1], "rt")]
for pid in sorted({r["pid"] for r in recs}):
    c = collections.defaultdict(lambda: [0, 0.0, 0])
    for r in recs:
        if r["pid"] != pid or r["target_ms"] is None or r["target_ms"] > 1000 or r["max_query_len"] > 7:
            continue
        k = sum(r["k"]) if r["k"] else (sum(r["lookup"]) if r["lookup"] else 0)
        kind = "L" if r["lookup"] else ("S" if k else ("W" if r["warm_ms"] > 0 else "C"))
        acc = 0 if not k or r["rejected"] is None else k - sum(r["rejected"])
        ms = r["target_ms"] + r["draft_ms"] + (r["warm_ms"] if kind != "L" else 0.0)
        key = ("b8" if r["batch"] >= 8 else "b<8", kind)
        c[key][0] += r["batch"] + acc
        c[key][1] += ms
        c[key][2] += 1
    total = sum(v[1] for v in c.values())
    print(f"pid {pid}: {total / 1e3:.1f} s in steps, {sum(v[0] for v in c.values()) / total:.4f} tokens per ms")
    for key, (tok, ms, n) in sorted(c.items()):
        print(f"  {key[0]:4s} {key[1]}  steps {n:5d}  share {ms / total:.3f}  tokens/ms {tok / ms:.4f}  ms/step {ms / n:.1f}")
