"""What one vLLM engine step costs for each draft length K, measured interleaved in one process.

Run in the vLLM environment (scripts/setup-vllm.sh), with nothing else running on the box:

    python bench/vllm_step_costs.py --batch 1 8 --ks 0 1 2 3 4 5 --max-new-tokens 128

One vLLM engine with HeteroSpec's proposer, its engine core in this process, whose plan is
replaced by a fixed schedule: step i drafts K = ks[i % len(ks)] tokens for every request (K = 0:
a plain step, the drafter does not run). The proposer's step trace (``HETEROSPEC_VLLM_TRACE``)
gives, per step, the target side (scheduling, the forward over the step's tokens, rejection
sampling), the draft's time and the drafts the target rejected. Interleaving the K's step by step keeps the machine's drift out
of the comparison that separate engines (one process per fixed K) cannot. Prints the median
milliseconds per K and batch size, the step cost relative to a plain step, the accepted drafts
per request a step of K must reach to break even, those it reached, and the speedup over plain
steps they imply; writes them as JSON (and a plot with matplotlib). The acceptance is a lower
bound of a fixed-K engine's: after each plain step of the schedule the draft lacks that step's
KV entries.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8, help="MT-bench questions (first turns)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="bench/out/vllm_step_costs.json")
    args = p.parse_args()
    if min(args.ks) < 0:
        p.error("--ks must be >= 0")

    trace = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False).name
    os.environ["HETEROSPEC_VLLM_TRACE"] = trace
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # the engine core (and the proposer) here
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams

    from heterospec.datasets import load_prompts
    from heterospec.policy import Plan
    from heterospec.vllm_plugin import proposer as prop
    from heterospec.vllm_plugin.__main__ import _paths, default_memory_fraction

    schedule = list(args.ks)
    step = {"i": 0}

    def fixed_plan(self, batch_size):
        k = schedule[step["i"] % len(schedule)]
        step["i"] += 1
        return Plan("fixed-0", speculate=False, binned=False) if k == 0 else self._chain_plan(f"fixed-{k}", k)

    prop.HeteroSpecProposer._plan = fixed_plan
    paths = _paths()
    llm = LLM(model=paths["target"], speculative_config={"method": "eagle3", "model": paths["draft"],
                                                         "num_speculative_tokens": max(max(args.ks), 1)},
              additional_config={"heterospec": {"learn": True, "costs": trace + ".costs.json"}},
              dtype=args.dtype, max_model_len=2048, max_num_seqs=max(args.batch), enforce_eager=True, seed=0,
              gpu_memory_utilization=default_memory_fraction(), async_scheduling=False)
    msgs = [[{"role": "user", "content": pr.text}] for pr in load_prompts("mtbench", n=args.n, seed=0)]
    llm.chat(msgs[:2], [SamplingParams(temperature=0, max_tokens=16)] * 2, use_tqdm=False)   # warm-up
    results = {}
    for b in args.batch:
        start = sum(1 for _ in open(trace))
        for s in range(0, len(msgs), b):
            llm.chat(msgs[s:s + b], [SamplingParams(temperature=0, max_tokens=args.max_new_tokens)] * len(msgs[s:s + b]),
                     use_tqdm=False)
        rows = [json.loads(line) for i, line in enumerate(open(trace)) if i >= start]
        per_k = {}
        for r in rows:
            if r["target_ms"] is None or r["batch"] != b or r["max_query_len"] > 1 + max(args.ks) or not r["plan"]:
                continue                      # a step with a prefill in it, or another batch size
            if not r["plan"].startswith("fixed-"):
                continue
            k = int(r["plan"].split("-")[1])
            acc = None
            if k > 0 and r.get("rejected") and r["k"]:
                acc = sum(max(0, kk - int(rj)) for kk, rj in zip(r["k"], r["rejected"])) / len(r["k"])
            per_k.setdefault(k, []).append((r["target_ms"], r["draft_ms"], acc))
        table = {}
        for k, v in sorted(per_k.items()):
            t = statistics.median(x for x, _, _ in v)
            d = statistics.median(y for _, y, _ in v)
            accs = [a for _, _, a in v if a is not None]
            acc = statistics.fmean(accs) if accs else 0.0
            table[k] = {"steps": len(v), "target_ms": round(t, 2), "draft_ms": round(d, 2), "step_ms": round(t + d, 2),
                        "accepted": round(acc, 3)}
        plain = table.get(0, {}).get("step_ms")
        print(f"batch {b}:  K  steps  target_ms  draft_ms  step_ms  x_plain  break-even  accepted  est. x plain tok/s")
        for k, row in table.items():
            rel = row["step_ms"] / plain if plain else float("nan")
            row["x_plain"] = round(rel, 3)
            row["break_even_accepted"] = round(rel - 1.0, 3)
            row["est_speedup"] = round((1.0 + row["accepted"]) / rel, 3)
            print(f"         {k}  {row['steps']:5d}  {row['target_ms']:9.2f}  {row['draft_ms']:8.2f}  "
                  f"{row['step_ms']:7.2f}  {rel:7.3f}  {rel - 1.0:10.3f}  {row['accepted']:8.3f}  {row['est_speedup']:6.3f}")
        results[b] = table
    out = {"command": " ".join(sys.argv), "results": results}
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        out["cpu_flags"] = sorted({x for x in ("avx512_bf16", "avx512f", "avx2", "amx_bf16") if f" {x}" in flags})
    except OSError:
        pass
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for b, table in results.items():
            ks = list(table)
            ax.plot(ks, [table[k]["x_plain"] for k in ks], marker="o", label=f"batch {b}")
        ax.set_xlabel("draft tokens per request K (0 = plain step)")
        ax.set_ylabel("step time / plain step")
        ax.set_title("vLLM step cost by draft length (one process, interleaved)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=120)
    except ImportError:
        pass
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
