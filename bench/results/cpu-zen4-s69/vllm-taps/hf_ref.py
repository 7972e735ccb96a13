import torch
from transformers import AutoModelForCausalLM
cap = torch.load("/tmp/s69/cmp/vllm_cap.pt")
m = AutoModelForCausalLM.from_pretrained("/root/.cache/heterospec/smollm2-135m-instruct", torch_dtype=torch.float32)
ids = cap["prompt_ids"][None]
with torch.no_grad():
    out = m(ids, output_hidden_states=True)
hs = out.hidden_states
v = cap["hidden0"]
for name, j in [("tap id 1", 0), ("tap id 14", 1), ("tap id 26", 2)]:
    vv = v[:, 576 * j:576 * (j + 1)]
    lid = [1, 14, 26][j]
    for cand in (lid - 1, lid, lid + 1):
        d = (hs[cand][0] - vv).abs().max().item()
        print(f"{name}: vLLM vs HF hidden_states[{cand}] max diff {d:.3f} (norm pos1 HF {hs[cand][0,1].norm():.1f}, vLLM {vv[1].norm():.1f})")
