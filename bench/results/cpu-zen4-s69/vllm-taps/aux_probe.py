import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM
from vllm.model_executor.models import llama as LL
from heterospec.vllm_plugin.__main__ import _paths
import vllm.model_executor.models.interfaces as I
seen = []
for cls in [LL.LlamaForCausalLM]:
    orig = cls.set_aux_hidden_state_layers
    def w(self, layers, orig=orig):
        seen.append(tuple(layers)); print("AUX LAYERS SET:", layers, flush=True); return orig(self, layers)
    cls.set_aux_hidden_state_layers = w
paths = _paths()
llm = LLM(model=paths["target"], dtype="float32", max_model_len=2048, max_num_seqs=1, enforce_eager=True, seed=0,
          gpu_memory_utilization=0.25, async_scheduling=False,
          speculative_config={"method": "eagle3", "model": paths["draft"], "num_speculative_tokens": 1})
print("seen", seen)
