"""Last-position logits of the prompt pass, bfloat16 with codes / bfloat16 16-bit / float32, four MT-bench prompts:
distance to float32 and the top-2 margin (why the two bfloat16 engines' greedy texts part)."""
import torch, heterospec
import heterospec.models.layers as layers
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
a = heterospec.Engine.from_pretrained(dtype=torch.bfloat16)
keep = layers.keep_block_source; layers.keep_block_source = lambda *x: None
b = heterospec.Engine.from_pretrained(dtype=torch.bfloat16)
layers.keep_block_source = keep
f = heterospec.Engine.from_pretrained(dtype=torch.float32)
for p in [q.text for q in load_prompts("mtbench", n=4)]:
    ids = a._encode(p, True)
    x = torch.tensor([ids]); pos = torch.arange(len(ids))[None]
    outs = {}
    with torch.inference_mode():
        for n, e in (("codes", a), ("16bit", b), ("f32", f)):
            t = e.target
            lo, _ = t(x, pos, t.new_cache(1, len(ids) + 8), torch.zeros(1, dtype=torch.long))
            outs[n] = lo[0, -1].float()
    line = []
    for n in ("codes", "16bit"):
        d = (outs[n] - outs["f32"]).abs()
        v, i = outs[n].topk(2)
        line.append(f"{n}: max|d| {d.max().item():.3f} mean {d.mean().item():.4f} top2 {i.tolist()} margin {v[0]-v[1]:.3f}")
    v, i = outs["f32"].topk(2)
    print(" | ".join(line), f"| f32 top2 {i.tolist()} margin {v[0]-v[1]:.3f}")
