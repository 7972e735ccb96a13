import json, sys, numpy as np
d = json.load(open(sys.argv[1]))
for s in ["mtbench", "humaneval", "gsm", "alpaca", "cnndm"]:
    for m in ["heterospec", "heterospec-nocorpus", "autoregressive"]:
        runs = [r for r in d["runs"] if r["set"] == s and r["method"] == m]
        if not runs: continue
        agg = {}
        for r in runs:
            for x in r["records"]:
                k = "corpus" if x.get("corpus") else "history" if x.get("history") else "lookup" if x.get("lookup") else "plain" if x.get("plain") else "spec"
                agg.setdefault(k, []).append((x["accept_len"] + 1, x["verify_s"] + x["draft_s"]))
        tot_s = sum(r["total_s"] for r in runs); tok = sum(r["new_tokens"] for r in runs)
        line = f"{s:9s} {m:20s} {1e3*tot_s/tok:6.2f} ms/tok | "
        for k, a in sorted(agg.items()):
            a = np.array(a)
            line += f"{k}: {len(a)} r, {a[:,0].mean():.2f} tok/r, {1e3*a[:,1].sum()/a[:,0].sum():.2f} ms/tok; "
        print(line)
