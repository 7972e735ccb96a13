import json, os, sys, time
def main():
    from vllm import LLM, SamplingParams
    from heterospec.vllm_plugin.__main__ import _paths
    p = _paths()
    method, tp, n, toks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    spec = None if method == "ar" else {"method": "eagle3", "model": os.environ.get("DRAFT", p["draft"]), "num_speculative_tokens": 3, **({"draft_tensor_parallel_size": int(os.environ["DTP"])} if os.environ.get("DTP") else {})}
    extra = {"heterospec": json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}} if method == "hs" else {}
    t0 = time.time()
    llm = LLM(model=p["target"], speculative_config=spec, additional_config=extra, dtype="float32",
              max_model_len=1024, max_num_seqs=8, enforce_eager=True, seed=0, tensor_parallel_size=tp,
              gpu_memory_utilization=0.08, async_scheduling=False)
    t1 = time.time()
    qs = ["Write a short poem about the sea.", "What is 17 times 23? Explain.", "List three uses of Python.",
          "Summarise the plot of Hamlet in two sentences.", "Repeat after me: one two three, one two three, one two three.",
          "Give me a recipe for pancakes.", "What is the capital of France and why is it famous?", "Explain recursion to a child."][:n]
    outs = llm.chat([[{"role": "user", "content": q}] for q in qs], [SamplingParams(temperature=0, max_tokens=toks) for _ in qs], use_tqdm=False)
    t2 = time.time()
    print(json.dumps({"method": method, "tp": tp, "start_s": t1 - t0, "gen_s": t2 - t1,
                      "ids": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
if __name__ == "__main__":
    main()
