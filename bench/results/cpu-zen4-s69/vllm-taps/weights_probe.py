import os, torch
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM
from vllm.v1.spec_decode import llm_base_proposer as LB
from heterospec.vllm_plugin.__main__ import _paths
from safetensors.torch import load_file
holder = {}
orig = LB.SpecDecodeBaseProposer.load_model
def w(self, target):
    r = orig(self, target); holder["d"] = self; return r
LB.SpecDecodeBaseProposer.load_model = w
paths = _paths()
llm = LLM(model=paths["target"], dtype="float32", max_model_len=2048, max_num_seqs=1, enforce_eager=True, seed=0,
          gpu_memory_utilization=0.25, async_scheduling=False,
          speculative_config={"method": "eagle3", "model": paths["draft"], "num_speculative_tokens": 1})
m = holder["d"].model
ck = load_file(os.path.join(paths["draft"], "model.safetensors"))
print("checkpoint keys:", sorted(ck))
for n, p in m.named_parameters():
    print(f"{n:50s} {tuple(p.shape)} mean|.| {p.float().abs().mean():.4f}")
for n, b in m.named_buffers():
    if b.numel() < 100000: print("buffer", n, tuple(b.shape), b.float().abs().mean().item())
print("ck norms:", {k: round(v.float().abs().mean().item(), 4) for k, v in ck.items() if 'norm' in k})
