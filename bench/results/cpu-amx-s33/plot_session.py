"""Block-coded weights (thirty-third session): left, tokens/s of each method with the target's float32
weights streamed as float32 vs as their GGUF codes (interleaved A/B, e2e_codes_ab_float32.txt);
right, tokens/s of each method per set in this session's five-set runs (float32 and AVX2 emulated).
python bench/results/cpu-amx-s33/plot_session.py"""
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
with open(os.path.join(HERE, "e2e_codes_ab_float32.txt")) as f:
    for line in f:
        m = re.match(r"(\w+)\s+float\s+([\d.]+) tok/s\s+codes\s+([\d.]+) tok/s", line)
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


fig, axes = plt.subplots(1, 3, figsize=(16, 4.2), gridspec_kw={"width_ratios": [1, 2, 2]})
ax = axes[0]
for i, m in enumerate(METHODS):
    f32, codes = ab[m]
    ax.bar(i - 0.18, f32, width=0.36, color=COLORS[m], alpha=0.4, label="float32 weights" if i == 0 else None)
    ax.bar(i + 0.18, codes, width=0.36, color=COLORS[m], label="GGUF codes" if i == 0 else None)
    ax.text(i + 0.18, codes, f"{codes / f32:.2f}x", ha="center", va="bottom", fontsize=8)
ax.set_xticks(range(3))
ax.set_xticklabels(["AR", "eagle3", "heterospec"])
ax.set_ylabel("tokens/s")
ax.set_title("float32 target: interleaved A/B, 10 prompts")
ax.legend(fontsize=7)
for ax, (run, title) in zip(axes[1:], (("f32", "float32, five sets (codes)"), ("avx2", "AVX2 emulated, five sets (codes)"))):
    t = tok_s(run)
    for j, m in enumerate(METHODS):
        ax.bar([i + (j - 1) * 0.27 for i in range(len(SETS))], [t[(s, m)] for s in SETS], width=0.27,
               color=COLORS[m], label=m)
    ax.set_xticks(range(len(SETS)))
    ax.set_xticklabels(SETS, fontsize=8)
    ax.set_title(title)
    ax.legend(fontsize=7)
fig.suptitle("Built-in pair, 2-vCPU Xeon (avx2 avx512_bf16 amx_bf16), batch 1, greedy; 0 outputs differ from autoregressive")
fig.tight_layout()
fig.savefig(os.path.join(HERE, "session.png"), dpi=110)
print("wrote", os.path.join(HERE, "session.png"))
