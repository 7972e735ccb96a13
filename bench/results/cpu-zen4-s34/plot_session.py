"""Streamed layers on a Zen 4 EPYC (thirty-fourth session): left, tokens/s of each method with the
target's layers run as modules vs as StreamedLayers (interleaved A/B, e2e_streamed_ab.txt); middle,
tokens/s per set in this session's five-set runs (float32, AVX2 emulated, bfloat16 where present);
right, each method's tokens/s over autoregressive's at batch 1-16 (f32-sweep/batch_sweep.json).
python bench/results/cpu-zen4-s34/plot_session.py"""
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

ab = {}
with open(os.path.join(HERE, "e2e_streamed_ab.txt")) as f:
    for line in f:
        m = re.match(r"(\w+)\s+modules\s+([\d.]+) tok/s\s+streamed\s+([\d.]+) tok/s", line)
        if m:
            ab[m.group(1)] = (float(m.group(2)), float(m.group(3)))


def tok_s(run):
    out = {}
    with open(os.path.join(HERE, run, "e2e.md")) as f:
        for line in f:
            m = re.match(r"\| (\w+) \| (\w+) \| ([\d.]+) \|", line)
            if m:
                out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


runs = [(r, t) for r, t in (("f32", "float32"), ("avx2", "AVX2 emulated"), ("bf16", "bfloat16"))
        if os.path.exists(os.path.join(HERE, r, "e2e.md"))]
fig, axes = plt.subplots(1, 2 + len(runs), figsize=(5 + 4.5 * (1 + len(runs)), 4.2),
                         gridspec_kw={"width_ratios": [1] + [2] * len(runs) + [1.6]})
ax = axes[0]
for i, m in enumerate(METHODS):
    before, after = ab[m]
    ax.bar(i - 0.18, before, width=0.36, color=COLORS[m], alpha=0.4, label="modules" if i == 0 else None)
    ax.bar(i + 0.18, after, width=0.36, color=COLORS[m], label="streamed layers" if i == 0 else None)
    ax.text(i + 0.18, after, f"{after / before:.2f}x", ha="center", va="bottom", fontsize=8)
ax.set_xticks(range(3))
ax.set_xticklabels(["AR", "eagle3", "heterospec"])
ax.set_ylabel("tokens/s")
ax.set_title("float32: interleaved A/B, 10 prompts")
ax.legend(fontsize=7, loc="lower right")
for ax, (run, title) in zip(axes[1:], runs):
    t = tok_s(run)
    for j, m in enumerate(METHODS):
        ax.bar([i + (j - 1) * 0.27 for i in range(len(SETS))], [t[(s, m)] for s in SETS], width=0.27,
               color=COLORS[m], label=m)
    ax.set_xticks(range(len(SETS)))
    ax.set_xticklabels(SETS, fontsize=8)
    ax.set_title(f"{title}, five sets, batch 1")
    ax.legend(fontsize=7)
ax = axes[-1]
sweep = json.load(open(os.path.join(HERE, "f32-sweep", "batch_sweep.json")))
for m in METHODS:
    rows = sorted((r["batch_size"], r["vs_autoregressive"]) for r in sweep["rows"] if r["method"] == m)
    ax.plot([b for b, _ in rows], [v for _, v in rows], "o-", color=COLORS[m], label=m)
ax.set_xscale("log", base=2)
ax.set_xlabel("batch size")
ax.set_ylabel("tokens/s / autoregressive's")
ax.set_title("float32 batch sweep")
ax.legend(fontsize=7)
fig.suptitle("Built-in pair, 2-core AMD EPYC Zen 4 (avx2 avx512_bf16, no AMX), greedy; 0 outputs differ from autoregressive")
fig.tight_layout()
fig.savefig(os.path.join(HERE, "session.png"), dpi=110)
print("wrote", os.path.join(HERE, "session.png"))
