"""Median target milliseconds of vLLM steps by the kind of the step and of the step before it
(P plain, S speculative), per engine process and batch size, from HETEROSPEC_VLLM_TRACE files.
Usage: python transitions.py TRACE.jsonl[.gz] ..."""
import gzip
import json
import statistics
import sys

for path in sys.argv[1:]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        recs = [json.loads(line) for line in f]
    for pid in sorted({r["pid"] for r in recs}):
        for B in sorted({r["batch"] for r in recs if r["pid"] == pid}):
            x = [r for r in recs if r["pid"] == pid and r["batch"] == B and r["target_ms"]
                 and r["max_query_len"] <= 7 and r["target_ms"] < 1000]     # no prefill, no idle gap
            spec = lambda r: bool(r["k"] and max(r["k"]) > 0)
            kinds = {}
            for a, b in zip(x, x[1:]):
                kinds.setdefault(("S" if spec(a) else "P") + ">" + ("S" if spec(b) else "P"), []).append(b["target_ms"])
            cells = "  ".join(f"{k} {len(v):4d} {statistics.median(v):6.1f}" if (v := kinds.get(k)) else f"{k}    0      -"
                              for k in ("P>P", "S>P", "P>S", "S>S"))
            print(f"{path.split('/')[-2] if '/' in path else path}  pid {pid}  batch {B}:  {cells}")
