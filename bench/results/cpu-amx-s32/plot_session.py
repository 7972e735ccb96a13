"""Tokens/s vs autoregressive per set (heterospec, eagle3) of this session's five-set runs, beside
the thirty-first session's runs: python bench/results/cpu-amx-s32/plot_session.py"""
import os
import re

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = [("float32", "../cpu-amx-s31/f32-glue", "f32"),
        ("AVX2 emulated", "../cpu-amx-s31/avx2-glue", "avx2"),
        ("bfloat16", "../cpu-amx-s31/bf16-final", "bf16")]
SETS = ["mtbench", "humaneval", "gsm", "alpaca", "cnndm", "**mean**"]


def speedups(run_dir):
    out = {}
    with open(os.path.join(HERE, run_dir, "e2e.md")) as f:
        for line in f:
            m = re.match(r"\| (\S+) \| (\w+) \| [\d.]* ?\| ([\d.]+)x \|", line)
            if m:
                out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
for ax, (title, before, now) in zip(axes, RUNS):
    x = range(len(SETS))
    for off, run, method, style in ((-0.3, before, "heterospec", dict(color="tab:blue", alpha=0.4)),
                                    (-0.1, now, "heterospec", dict(color="tab:blue")),
                                    (0.1, before, "eagle3", dict(color="tab:orange", alpha=0.4)),
                                    (0.3, now, "eagle3", dict(color="tab:orange"))):
        s = speedups(run)
        label = f"{method}, {'s31' if run == before else 's32 (tree_attention)'}"
        ax.bar([i + off for i in x], [s.get((k, method), 0) for k in SETS], width=0.2, label=label, **style)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(list(x))
    ax.set_xticklabels([k.strip("*") for k in SETS], fontsize=8)
    ax.set_title(title)
axes[0].set_ylabel("tokens/s vs autoregressive (same run)")
axes[0].legend(fontsize=7)
fig.suptitle("Built-in pair, 2-vCPU Xeon (avx2 avx512_bf16 amx_bf16); each bar a ratio within its own run")
fig.tight_layout()
fig.savefig(os.path.join(HERE, "session.png"), dpi=110)
print("wrote", os.path.join(HERE, "session.png"))
