import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import vllm.model_executor.layers.rotary_embedding as R
orig = R.get_rope
def w(*a, **k):
    print("GET_ROPE", a[:3] if a else '', {kk: v for kk, v in k.items() if kk != 'dtype'}, flush=True)
    return orig(*a, **k)
R.get_rope = w
import vllm.model_executor.models.llama as LL
LL.get_rope = w
from vllm import LLM
from heterospec.vllm_plugin.__main__ import _paths
paths = _paths()
llm = LLM(model=paths["target"], dtype="float32", max_model_len=2048, max_num_seqs=1, enforce_eager=True, seed=0,
          gpu_memory_utilization=0.25, async_scheduling=False,
          speculative_config={"method": "eagle3", "model": paths["draft"], "num_speculative_tokens": 1})
