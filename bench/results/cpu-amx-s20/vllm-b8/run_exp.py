"""Diagnostic: is a plugin plain step (drafter off, cold) slower than a vLLM autoregressive step at batch 8?"""
import argparse, json, os, sys
sys.path.insert(0, "/work/main/bench")
import vllm_compare as vc
if __name__ == "__main__":
    out = "/tmp/work/exp1"
    args = argparse.Namespace(memory_gib=3.0, batch=[8], max_new_tokens=128, repeats=3, out=out, preload=vc._preload())
    prompts = "/work/main/bench/out/vllm-s19/prompts.json"
    runs = [("ar", "autoregressive", 1, {}, {}),
            ("hs-cold-plain", "heterospec", 6, {"HETEROSPEC_VLLM_TRACE": out + "/trace-plain.jsonl"},
             {"costs": out + "/costs_plain.json", "learn": False}),
            ("hs", "heterospec", 6, {"HETEROSPEC_VLLM_TRACE": out + "/trace-hs.jsonl"}, {}),
            ("eagle3-k1", "eagle3", 1, {}, {})]
    res = vc._vllm_interleaved(runs, prompts, 8, args)
    base = res[("ar", 8)]
    for (lab, b), r in res.items():
        print(lab, b, r["tokens"], round(r["seconds"], 2), "tok/s", round(r["tokens"] / r["seconds"], 2),
              "ratio", round((r["tokens"] / r["seconds"]) / (base["tokens"] / base["seconds"]), 3),
              "same-as-ar", r["token_ids"] == base["token_ids"])
