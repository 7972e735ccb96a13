"""From `heterospec bench` e2e.json files: per prompt, the mean verify_s of heterospec's plain records over
autoregressive's verify_s per target call (prompts with >= 20 plain rounds); median over prompts.
Usage (from bench/results): python cpu-emr-s75/plain_vs_ar_steps.py DIR [DIR ...]"""
import json, statistics as S, sys
for f in sys.argv[1:]:
    by = {}
    for r in json.load(open(f"{f}/e2e.json"))["runs"]:
        by.setdefault(r["prompt_id"], {})[r["method"]] = r
    ratios = []
    for m in by.values():
        plain = [x["verify_s"] for x in m["heterospec"]["records"] if x["plain"]]
        if len(plain) >= 20:
            ar = m["autoregressive"]
            ratios.append(S.mean(plain) / (ar["verify_s"] / ar["target_calls"]))
    print(f"{f}: {len(ratios)} prompts, median {S.median(ratios):.3f}, mean {S.mean(ratios):.3f}")
