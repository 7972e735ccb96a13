"""Where speculation stands on a Zen 4 EPYC in the thirty-fifth session: left, a target forward's
time against its rows (rows.txt) with a K=1 round's parts stacked beside a plain step
(k1parts.txt); middle, tokens/s per set in the five-set runs (float32, bfloat16); right, each
method's tokens/s over autoregressive's at batch 1-16 (f32-sweep/batch_sweep.json).
python bench/results/cpu-zen4-s35/plot_session.py"""
import json
import os
import re

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ["autoregressive", "eagle3", "heterospec"]
COLORS = {"autoregressive": "tab:gray", "eagle3": "tab:orange", "heterospec": "tab:blue"}
SETS = ["mtbench", "humaneval", "gsm", "alpaca", "cnndm"]


def numbers(name, pattern):
    with open(os.path.join(HERE, name)) as f:
        return [tuple(float(g) for g in m.groups()) for m in map(re.compile(pattern).match, f) if m]


def tok_s(run):
    with open(os.path.join(HERE, run, "e2e.md")) as f:
        return {(m.group(1), m.group(2)): float(m.group(3))
                for m in map(re.compile(r"\| (\w+) \| (\w+) \| ([\d.]+) \|").match, f) if m}


rows = numbers("rows.txt", r"(\d+) ([\d.]+) ms")
parts = {m[1]: m[2] for m in (re.match(r"\s+(\S+)\s+n=\s*\d+ per-round\s+([\d.]+) ms", l)
                              for l in open(os.path.join(HERE, "k1parts.txt"))) if m}
fig, axes = plt.subplots(1, 5, figsize=(24, 4.4), gridspec_kw={"width_ratios": [1.4, 0.8, 2, 2, 1.5]})
ax = axes[0]
ax.plot([r for r, _ in rows], [t for _, t in rows], "o-", color="tab:blue")
ax.set_xlabel("rows in one target forward (a tree verify's tokens)")
ax.set_ylabel("ms")
ax.set_title("float32 target forward vs rows (context 300)")
ax = axes[1]
bottom = 0.0
for key, color in (("_verify_half", "tab:blue"), ("_draft_half", "tab:orange"), ("_commit", "tab:green")):
    ax.bar(1, float(parts[key]), bottom=bottom, color=color, label=key.strip("_"))
    bottom += float(parts[key])
ax.bar(0, rows[0][1], color="tab:gray", label="plain step (1 row)")
ax.set_xticks([0, 1])
ax.set_xticklabels(["plain", "K=1 round\n(1.40 tokens)"])
ax.set_ylabel("ms")
ax.set_title("a K=1 chain round")
ax.legend(fontsize=7)
for ax, (run, title) in zip(axes[2:4], (("f32", "float32"), ("bf16", "bfloat16"))):
    t = tok_s(run)
    for j, m in enumerate(METHODS):
        ax.bar([i + (j - 1) * 0.27 for i in range(len(SETS))], [t[(s, m)] for s in SETS], width=0.27,
               color=COLORS[m], label=m)
    ax.set_xticks(range(len(SETS)))
    ax.set_xticklabels(SETS, fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{title}, five sets, batch 1")
    ax.legend(fontsize=7)
ax = axes[4]
sweep = json.load(open(os.path.join(HERE, "f32-sweep", "batch_sweep.json")))
for m in METHODS:
    pts = sorted((r["batch_size"], r["vs_autoregressive"]) for r in sweep["rows"] if r["method"] == m)
    ax.plot([b for b, _ in pts], [v for _, v in pts], "o-", color=COLORS[m], label=m)
ax.set_xscale("log", base=2)
ax.set_xlabel("batch size")
ax.set_ylabel("tokens/s / autoregressive's")
ax.set_title("float32 batch sweep")
ax.legend(fontsize=7)
fig.suptitle("Built-in pair, 2-core AMD EPYC Zen 4 (avx2 avx512_bf16, no AMX), greedy; 0 outputs differ from autoregressive")
fig.tight_layout()
fig.savefig(os.path.join(HERE, "session.png"), dpi=100)
print("wrote", os.path.join(HERE, "session.png"))
