import os, json, torch
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.v1.spec_decode import llm_base_proposer as LB
from heterospec.vllm_plugin.__main__ import _paths
cap = {"calls": 0}
orig = LB.SpecDecodeBaseProposer.propose
def wrapped(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, *a, **k):
    if cap["calls"] < 3:
        cap[f"hidden{cap['calls']}"] = target_hidden_states.clone()
        cap[f"tok{cap['calls']}"] = target_token_ids.clone(); cap[f"pos{cap['calls']}"] = target_positions.clone()
        m = self.model
        cap[f"fc{cap['calls']}"] = m.combine_hidden_states(target_hidden_states).clone()
    cap["calls"] += 1
    return orig(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, *a, **k)
LB.SpecDecodeBaseProposer.propose = wrapped
origS = LB.SpecDecodeBaseProposer._sample_draft_tokens
def ws(self, hidden_states, sampling_metadata):
    n = cap["calls"] - 1
    if n < 3:
        cap[f"sample_hidden{n}"] = hidden_states.clone()
        cap[f"logits{n}"] = self.model.compute_logits(hidden_states).clone()
    return origS(self, hidden_states, sampling_metadata)
LB.SpecDecodeBaseProposer._sample_draft_tokens = ws
paths = _paths()
prompts = json.load(open("/tmp/s69/vllm-b1/prompts.json"))
llm = LLM(model=paths["target"], dtype="float32", max_model_len=2048, max_num_seqs=1, enforce_eager=True, seed=0,
          gpu_memory_utilization=0.25, async_scheduling=False, enable_prefix_caching=False,
          speculative_config={"method": "eagle3", "model": paths["draft"], "num_speculative_tokens": 1})
o = llm.chat([[{"role": "user", "content": prompts[0]}]], [SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False)[0]
cap["prompt_ids"] = torch.tensor(o.prompt_token_ids); cap["out"] = torch.tensor(o.outputs[0].token_ids)
torch.save(cap, "/tmp/s69/cmp/vllm_cap.pt"); print({k: (tuple(v.shape) if torch.is_tensor(v) else v) for k, v in cap.items()})
