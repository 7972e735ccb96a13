"""Plot of this session's vLLM runs (issue 13): tokens/s vs vLLM autoregressive, per set and batch,
vLLM eagle3 K=1/K=2 and the plugin with context lookup off / on; dots: each interleaved pass."""
import json
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

here = os.path.dirname(os.path.abspath(__file__))
runs = [("MT-bench", "vllm-mtbench-2p", (1, 8)), ("HumanEval", "vllm-humaneval-2p", (1,)),
        ("HumanEval (16 prompts)", "vllm-humaneval-b8", (8,))]
systems = [("vllm eagle3 K=1", "eagle3 K=1"), ("vllm eagle3 K=2", "eagle3 K=2"),
           ("vllm heterospec (K<=6), lookup off", "plugin, lookup off"), ("vllm heterospec (K<=6)", "plugin (lookup on)")]
panels = [(name, d, b) for name, d, bs in runs for b in bs]
fig, ax = plt.subplots(figsize=(10, 4.5))
w = 0.8 / len(systems)
for si, (label, short) in enumerate(systems):
    xs, ys = [], []
    for pi, (name, d, b) in enumerate(panels):
        rows = json.load(open(os.path.join(here, d, "vllm_compare.json")))
        r = next((r for r in rows if r["system"] == label and r["batch"] == b), None)
        if r is None:
            continue
        x = pi + (si - (len(systems) - 1) / 2) * w
        xs.append(x)
        ys.append(r["vs_vllm_ar"])
        ax.plot([x] * len(r.get("pass_vs_vllm_ar", [])), r.get("pass_vs_vllm_ar", []), "k.", ms=4)
    ax.bar(xs, ys, w, label=short)
ax.axhline(1.0, color="k", lw=0.8)
ax.set_xticks(range(len(panels)), [f"{name}\nbatch {b}" for name, _, b in panels])
ax.set_ylabel("tokens/s vs vLLM autoregressive")
ax.set_title("vLLM 0.32.0 CPU, Zen 4 (avx512_bf16), float32, greedy, engines interleaved (dots: passes)")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(here, "session.png"), dpi=110)
