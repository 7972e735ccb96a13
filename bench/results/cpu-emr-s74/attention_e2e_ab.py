"""End to end A/B of this session's tree_attention (16-bit K/V widened in the kernel, phase 3 over pairs of
rows, first-row prefetches): two builds of heterospec, one process each, ABBA order ("new" = this tree; "old" =
the tree at OLD_TREE, the kernel before). Each process: the built-in pair, a DTYPE target (bfloat16 by
default), 4 MT-bench prompts x 96 tokens, greedy; autoregressive,
eagle3 and heterospec per prompt in turn. Prints tokens/s per build and method, the paired ratios new / old,
and whether each build's texts agree across builds and with autoregressive.
Usage: python attention_e2e_ab.py OLD_TREE [PASSES [DTYPE]]"""
import json, os, statistics, subprocess, sys

CHILD = r"""
import json, sys, time, torch, heterospec
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
e = heterospec.Engine.from_pretrained(dtype=getattr(torch, sys.argv[1]))
prompts = [p.text for p in load_prompts("mtbench", n=4)]
methods = ("autoregressive", "eagle3", "heterospec")
for m in methods:
    e.generate(prompts[0], max_new_tokens=32, method=m)
out = {m: {"tokens": 0, "seconds": 0.0, "texts": []} for m in methods}
for p in prompts:
    for m in methods:
        t0 = time.perf_counter(); r = e.generate(p, max_new_tokens=96, method=m)
        out[m]["seconds"] += time.perf_counter() - t0; out[m]["tokens"] += len(r.token_ids)
        out[m]["texts"].append(r.token_ids)
print("RESULT " + json.dumps(out))
"""

here = os.path.dirname(os.path.abspath(__file__))
new_tree = os.path.abspath(os.path.join(here, "..", "..", ".."))
old_tree = sys.argv[1]
passes = int(sys.argv[2]) if len(sys.argv) > 2 else 2
dtype = sys.argv[3] if len(sys.argv) > 3 else "bfloat16"
runs = {"new": [], "old": []}
for i in range(passes):
    for build in (("new", "old") if i % 2 == 0 else ("old", "new")):
        tree = new_tree if build == "new" else old_tree
        p = subprocess.run([sys.executable, "-c", CHILD, dtype], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": tree}, cwd=tree)
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        assert line, p.stderr[-3000:]
        r = json.loads(line[0][7:])
        runs[build].append(r)
        print(build, {m: round(v["tokens"] / v["seconds"], 1) for m, v in r.items()}, flush=True)
summary = {}
for m in ("autoregressive", "eagle3", "heterospec"):
    rate = {b: [r[m]["tokens"] / r[m]["seconds"] for r in runs[b]] for b in runs}
    summary[m] = {"new tok/s": round(statistics.mean(rate["new"]), 1), "old tok/s": round(statistics.mean(rate["old"]), 1),
                  "new / old (paired)": [round(a / b, 3) for a, b in zip(rate["new"], rate["old"])],
                  "texts equal new vs old": runs["new"][0][m]["texts"] == runs["old"][0][m]["texts"]}
for b in runs:
    summary[f"{b}: heterospec / autoregressive (per pass)"] = [
        round((r["heterospec"]["tokens"] / r["heterospec"]["seconds"]) / (r["autoregressive"]["tokens"] / r["autoregressive"]["seconds"]), 3)
        for r in runs[b]]
    summary[f"{b}: greedy texts equal to autoregressive"] = {
        m: sum(a == t for a, t in zip(runs[b][0]["autoregressive"]["texts"], runs[b][0][m]["texts"])) for m in ("eagle3", "heterospec")}
print(json.dumps(summary, indent=1))
