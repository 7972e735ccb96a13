"""Plot of the thirty-sixth session: HeteroSpec with and without context lookup against
autoregressive, per set (five-set runs) and per batch size (sweeps). Reads the JSON files next
to this script; writes session.png."""
import gzip
import json
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
SETS = ["mtbench", "humaneval", "gsm", "alpaca", "cnndm"]
RUNS = [("f32", "float32"), ("bf16", "bfloat16"), ("avx2-f32", "float32, AVX2 emulated")]
SWEEPS = [("f32-sweep", "float32, mtbench+alpaca"), ("f32-sweep-5sets", "float32, five sets"),
          ("avx2-f32-sweep", "float32 AVX2 emulated, mtbench+alpaca")]


def speedups(path):
    with gzip.open(path, "rt") as f:
        runs = json.load(f)["runs"]
    out = {}
    for s in SETS:
        tps = {}
        for m in ("autoregressive", "heterospec", "heterospec-nolookup", "eagle3"):
            rs = [r for r in runs if r["set"] == s and r["method"] == m]
            tps[m] = sum(r["new_tokens"] for r in rs) / sum(r["total_s"] for r in rs)
        out[s] = {m: tps[m] / tps["autoregressive"] for m in tps}
    return out


fig, axes = plt.subplots(2, 3, figsize=(15, 8))
for ax, (d, title) in zip(axes[0], RUNS):
    p = os.path.join(HERE, d, "e2e.json.gz")
    if not os.path.exists(p):
        ax.set_visible(False)
        continue
    sp = speedups(p)
    x = range(len(SETS))
    for i, (m, c) in enumerate((("eagle3", "tab:gray"), ("heterospec-nolookup", "tab:blue"), ("heterospec", "tab:orange"))):
        ax.bar([xi + (i - 1) * 0.27 for xi in x], [sp[s][m] for s in SETS], 0.27, label=m, color=c)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(x), SETS)
    ax.set_ylabel("tokens/s vs autoregressive")
    ax.set_title(f"batch 1, {title}")
    ax.legend(fontsize=8)
for ax, (d, title) in zip(axes[1], SWEEPS):
    p = os.path.join(HERE, d, "batch_sweep.json")
    if not os.path.exists(p):
        ax.set_visible(False)
        continue
    rows = json.load(open(p))["rows"]
    for m, c in (("heterospec-nolookup", "tab:blue"), ("heterospec", "tab:orange")):
        pts = sorted((r["batch_size"], r["vs_autoregressive"] if "vs_autoregressive" in r else r.get("speedup"))
                     for r in rows if r["method"] == m)
        ax.plot([b for b, _ in pts], [v for _, v in pts], "o-", label=m, color=c)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0.8, 1.15)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s vs autoregressive")
    ax.set_title(f"batch sweep, {title}")
    ax.legend(fontsize=8)
fig.suptitle("Context lookup (heterospec.lookup), 2-core AMD EPYC Zen 4 (avx2 avx512f avx512_bf16), torch 2.13.0+cpu")
fig.tight_layout()
fig.savefig(os.path.join(HERE, "session.png"), dpi=90)
print("wrote", os.path.join(HERE, "session.png"))
