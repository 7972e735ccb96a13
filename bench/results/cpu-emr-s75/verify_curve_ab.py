"""A/B of the target's forward latency over T tokens (context 256, float32), two builds of heterospec in
separate processes, ABBA order ("new" = this tree, "old" = OLD_TREE). Each process: verify_latency_curve
(median of REPEATS). Prints per T the median over passes of each build's latency and the paired ratio.
Usage: python verify_curve_ab.py OLD_TREE [PASSES] [SIZES...]   (ISA cap from the environment)"""
import json, os, statistics, subprocess, sys

CHILD = r"""
import json, sys, torch, heterospec
from heterospec.bench import verify_latency_curve
torch.set_num_threads(2)
e = heterospec.Engine.from_pretrained()
sizes = [int(s) for s in sys.argv[1:]]
c = verify_latency_curve(e, sizes=sizes, context=256, repeats=9, out_dir=None)
print("RESULT " + json.dumps(c))
"""
here = os.path.dirname(os.path.abspath(__file__))
new_tree = os.path.abspath(os.path.join(here, "..", "..", ".."))
old_tree = sys.argv[1]
passes = int(sys.argv[2]) if len(sys.argv) > 2 else 4
sizes = sys.argv[3:] or ["1", "2", "4", "8", "12", "16", "24", "32"]
runs = {"new": [], "old": []}
for i in range(passes):
    for build in (("new", "old") if i % 2 == 0 else ("old", "new")):
        tree = new_tree if build == "new" else old_tree
        p = subprocess.run([sys.executable, "-c", CHILD, *sizes], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": tree}, cwd=tree)
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        assert line, p.stderr[-3000:]
        runs[build].append(json.loads(line[0][7:]))

summary = {}
for T in runs["new"][0]["latency_ms"]:
    new = [r["latency_ms"][T] for r in runs["new"]]
    old = [r["latency_ms"][T] for r in runs["old"]]
    summary[T] = {"old ms": round(statistics.median(old), 2), "new ms": round(statistics.median(new), 2),
                  "new / old (paired)": [round(a / b, 3) for a, b in zip(new, old)],
                  "median ratio": round(statistics.median(a / b for a, b in zip(new, old)), 3)}
print(json.dumps(summary, indent=1))
