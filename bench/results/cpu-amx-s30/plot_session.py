"""Mean speedup vs autoregressive (five sets) of every five-set run of this session, beside the
twenty-ninth session's: python bench/results/cpu-amx-s30/plot_session.py"""
import os
import re

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = [("float32\ns29", "../cpu-amx-s29/f32-stream2"), ("float32\nf32 draft", "f32-auto"),
        ("float32\n+glue", "f32-glue"), ("float32\n+fused", "f32-final"),
        ("AVX2 emul.\ns29", "../cpu-amx-s29/avx2-stream"), ("AVX2 emul.\nnow", "avx2-final"),
        ("bfloat16\ns29", "../cpu-amx-s29/bf16"), ("bfloat16\nnow", "bf16-final")]


def means(run_dir):
    out = {}
    with open(os.path.join(HERE, run_dir, "e2e.md")) as f:
        for line in f:
            m = re.match(r"\| \*\*mean\*\* \| (\w+) \| \| ([\d.]+)x \| ([\d.]+)x", line)
            if m:
                out[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    return out


rows = [(label, means(d)) for label, d in RUNS if os.path.exists(os.path.join(HERE, d, "e2e.md"))]
fig, ax = plt.subplots(figsize=(10, 4))
x = range(len(rows))
for off, method, color in ((-0.2, "eagle3", "tab:orange"), (0.2, "heterospec", "tab:blue")):
    vals = [r[method][0] for _, r in rows]
    ax.bar([i + off for i in x], vals, width=0.4, label=method, color=color)
    for i, v in zip(x, vals):
        ax.text(i + off, v + 0.01, f"{v:.2f}", ha="center", fontsize=7)
ax.axhline(1.0, color="gray", lw=0.8)
ax.axhline(1.3, color="gray", lw=0.8, ls="--")
ax.set_xticks(list(x))
ax.set_xticklabels([r[0] for r in rows], fontsize=8)
ax.set_ylabel("tokens/s vs autoregressive (mean of 5 sets)")
ax.set_title("Built-in pair, 2-vCPU Xeon (avx2 avx512_bf16 amx_bf16); AVX2 emul.: ISA capped at AVX2")
ax.legend()
fig.tight_layout()
fig.savefig(os.path.join(HERE, "session.png"), dpi=120)
print("wrote", os.path.join(HERE, "session.png"))
