"""Five-set means (speedup over autoregressive, each from its own interleaved run) before and
after stream_linear: python bench/results/cpu-amx-s29/plot_before_after.py"""
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
# (label, eagle3 / AR, heterospec / AR): bench/RESULTS.md, sessions 28 / 21 (before) and 29 (after)
RUNS = {
    "float32, AMX box": [("before (s28, f32-new)", 1.01, 1.22), ("after (f32-stream2)", 1.25, 1.32)],
    "AVX2 emulated, float32": [("before (s21, avx2-emulated)", 0.85, 0.99), ("after (avx2-stream)", 1.11, 1.20)],
}
fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
for ax, (title, runs) in zip(axes, RUNS.items()):
    xs = range(len(runs))
    ax.bar([x - 0.18 for x in xs], [r[1] for r in runs], 0.36, label="eagle3")
    ax.bar([x + 0.18 for x in xs], [r[2] for r in runs], 0.36, label="heterospec (fitted)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), [r[0] for r in runs], fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
axes[0].set_ylabel("speedup over autoregressive (five-set mean)")
axes[0].legend()
fig.suptitle("stream_linear: the verify-friendly CPU linear (2-vCPU Xeon, avx512_bf16 amx_bf16)", fontsize=10)
fig.tight_layout()
fig.savefig(os.path.join(HERE, "before_after.png"), dpi=120)
