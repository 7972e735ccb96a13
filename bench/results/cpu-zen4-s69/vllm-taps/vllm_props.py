import os, json, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.v1.spec_decode import llm_base_proposer as LB
from heterospec.vllm_plugin.__main__ import _paths
props = []
orig = LB.SpecDecodeBaseProposer.propose
def wrapped(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, next_token_ids,
            token_indices_to_sample, common_attn_metadata, sampling_metadata, *a, **k):
    out = orig(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, next_token_ids,
               token_indices_to_sample, common_attn_metadata, sampling_metadata, *a, **k)
    rej = k.get("num_rejected_tokens_gpu")
    props.append({"pos": target_positions.tolist(), "tok": target_token_ids.tolist(), "next": next_token_ids.tolist(),
                  "rej": None if rej is None else rej.tolist(), "draft": out.tolist(),
                  "sample_idx": None if token_indices_to_sample is None else token_indices_to_sample.tolist()})
    return out
LB.SpecDecodeBaseProposer.propose = wrapped
paths = _paths()
prompts = json.load(open("/tmp/s69/vllm-b1/prompts.json"))
llm = LLM(model=paths["target"], dtype="float32", max_model_len=2048, max_num_seqs=1, enforce_eager=True, seed=0,
          gpu_memory_utilization=0.25, async_scheduling=False,
          speculative_config={"method": "eagle3", "model": paths["draft"], "num_speculative_tokens": 1})
res = []
for p in prompts:
    start = len(props)
    o = llm.chat([[{"role": "user", "content": p}]], [SamplingParams(temperature=0, max_tokens=128)], use_tqdm=False)[0]
    res.append({"prompt_ids": list(o.prompt_token_ids), "out": list(o.outputs[0].token_ids), "props": props[start:]})
json.dump(res, open("/tmp/s69/cmp/vllm_props.json", "w"))
print("ok", len(res))
