"""The thirty-eighth session's vLLM runs: tokens/s vs vLLM autoregressive, per pass, for each run
(python plot_session.py -> session.png)."""
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
runs = [("static-b8-6p", "MT-bench b8, static\n16 prompts, 6 passes"),
        ("static-b8-ab", "MT-bench b8, static\n16 prompts, 4 passes"),
        ("continuous-b8-ab1", "MT-bench b8, continuous\n32 prompts, 3 passes"),
        ("continuous-b8-ab2", "MT-bench b8, continuous\n32 prompts, 3 passes (final)"),
        ("b1-ab", "MT-bench b1\n8 prompts, 2 passes"),
        ("continuous-b8-stream-ab", "b8 continuous, 32 prompts, 3 passes\nbase2 = without draft_stream"),
        ("b1-stream-ab", "b1, 8 prompts, 2 passes\nbase2 = without draft_stream")]
fig, axes = plt.subplots(1, len(runs) + 1, figsize=(25, 4.8), sharey=True)
for ax, (d, title) in zip(axes, runs):
    path = os.path.join(here, d, "vllm_compare.json")
    if not os.path.exists(path):
        ax.set_title(title + "\n(missing)")
        continue
    rows = [r for r in json.load(open(path)) if r["system"] != "vllm autoregressive"]
    for i, r in enumerate(rows):
        ax.bar(i, r["vs_vllm_ar"], color="C%d" % i)
        ps = r.get("pass_vs_vllm_ar") or []
        ax.plot([i] * len(ps), ps, "k.", ms=4)
    ax.set_xticks(range(len(rows)), [r["system"].replace("vllm heterospec (K<=6)", "plugin").replace("vllm ", "")
                                     for r in rows], rotation=35, ha="right", fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_title(title, fontsize=9)
p = json.load(open(os.path.join(here, "never-drafts-aab", "passes.json")))
ax = axes[-1]
for i, lab in enumerate(["ar-b", "never"]):
    ratios = [x / y for x, y in zip(p[lab], p["ar-a"])]
    ax.bar(i, sum(ratios) / len(ratios), color="C%d" % (i + 5))
    ax.plot([i] * len(ratios), ratios, "k.", ms=4)
ax.set_xticks([0, 1], ["2nd vLLM AR", "plugin,\nnever drafts"], fontsize=8)
ax.axhline(1.0, color="k", lw=0.8)
ax.set_title("b8, 8 prompts, 16 passes:\nvs a 1st vLLM AR engine", fontsize=9)
axes[0].set_ylabel("tokens/s / vLLM autoregressive (dots: passes)")
fig.suptitle("vLLM 0.32.0 CPU + HeteroSpec, 2-core Zen 4 (avx512_bf16, no AMX), float32 greedy; "
             "base = the plugin before this session, base2 = this session before draft_stream")
fig.tight_layout()
fig.savefig(os.path.join(here, "session.png"), dpi=100)
