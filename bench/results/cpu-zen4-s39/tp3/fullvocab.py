"""The shipped draft with a full-vocabulary head (for vLLM TP=3: 8,192 rows do not split in 3)."""
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
src, target, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
w = load_file(src / "model.safetensors")
t = {}
for f in sorted(target.glob("*.safetensors")):
    t.update(load_file(f))
head = (t.get("lm_head.weight", t["model.embed_tokens.weight"])).to(torch.float16).clone()
ids = torch.arange(w["d2t"].numel()) + w["d2t"]
head[ids] = w["lm_head.weight"]
w["lm_head.weight"] = head
del w["d2t"], w["t2d"]
save_file(w, out / "model.safetensors")
cfg = json.loads((src / "config.json").read_text()); cfg["draft_vocab_size"] = cfg["vocab_size"]
(out / "config.json").write_text(json.dumps(cfg, indent=1))
for f in src.glob("*.json"):
    if f.name != "config.json":
        shutil.copy(f, out / f.name)
print(out)
