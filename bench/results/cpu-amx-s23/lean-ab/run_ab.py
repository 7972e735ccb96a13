"""Lean steps A/B at batch 8: vLLM AR, vLLM eagle3 K=1, the plugin never drafting with lean steps on / off.
Four engines up at once, taking turns per prompt group (bench/vllm_compare.py's harness); per-pass ratios."""
import argparse, json, sys
sys.path.insert(0, "/work/main/bench")
import vllm_compare as vc
if __name__ == "__main__":
    out = sys.argv[1]
    args = argparse.Namespace(memory_gib=3.0, batch=[8], max_new_tokens=128, repeats=4, out=out, preload=vc._preload())
    costs = "/tmp/work/prof23/costs-never-drafts.json"
    runs = [("ar", "autoregressive", 1, {}, {}),
            ("eagle3-k1", "eagle3", 1, {}, {}),
            ("never-lean", "heterospec", 6, {}, {"costs": costs, "learn": False}),
            ("never-off", "heterospec", 6, {}, {"costs": costs, "learn": False, "lean_steps": False})]
    res = vc._vllm_interleaved(runs, "/work/main/bench/out/vllm-s19/prompts.json", 8, args)
    base = res[("ar", 8)]
    rows = []
    for (lab, b), r in res.items():
        passes = [round((t / s) / (bt / bs), 3) for (t, s), (bt, bs) in zip(r["passes"], base["passes"])]
        rows.append({"system": lab, "tok_s": r["tokens"] / r["seconds"], "vs_ar": (r["tokens"] / r["seconds"]) / (base["tokens"] / base["seconds"]),
                     "pass_vs_ar": passes, "pass_tok_s": [t / s for t, s in r["passes"]], "same_as_ar": r["token_ids"] == base["token_ids"]})
        print(lab, round(rows[-1]["tok_s"], 2), round(rows[-1]["vs_ar"], 3), passes, rows[-1]["same_as_ar"], flush=True)
    json.dump(rows, open(out + "/ab.json", "w"), indent=1)
