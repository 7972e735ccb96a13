"""A/A/B: two vLLM AR engines and the never-drafting plugin, interleaved, batch 8; per-pass seconds."""
import json, os, sys, types
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/bench")
import vllm_compare as vc
from heterospec.datasets import load_prompts
out = sys.argv[1]; reps = int(sys.argv[2]); extra = sys.argv[3:] 
os.makedirs(out, exist_ok=True)
texts = [p.text for p in load_prompts("mtbench", n=8, seed=0)]
pf = os.path.join(out, "prompts.json"); json.dump(texts, open(pf, "w"))
args = types.SimpleNamespace(memory_gib=2.0, batch=[8], max_new_tokens=128, temperature=0.0, seed=None,
                             out=out, repeats=reps, in_process=True, preload=vc._preload())
here = {"PYTHONPATH": "/work/main"}
runs = [("ar-a", "autoregressive", 1, {}, {}), ("ar-b", "autoregressive", 1, {}, {}),
        ("never", "heterospec", 6, here, {"costs": vc._never_drafting_costs(out), "learn": False})]
if "nolookup" in extra:
    runs.append(("never-nolookup", "heterospec", 6, here, {"costs": vc._never_drafting_costs(out), "learn": False, "lookup": False}))
res = vc._vllm_interleaved(runs, pf, len(texts), args)
table = {lab: [t / s for t, s in r["passes"]] for (lab, b), r in res.items()}
json.dump(table, open(os.path.join(out, "passes.json"), "w"), indent=1)
for lab, v in table.items():
    print(lab, " ".join(f"{x:.1f}" for x in v), "mean", f"{sum(v)/len(v):.1f}", "ratio to ar-a per pass",
          " ".join(f"{x/y:.3f}" for x, y in zip(v, table["ar-a"])))
