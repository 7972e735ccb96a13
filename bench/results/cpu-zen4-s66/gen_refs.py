# Greedy target outputs on the five benchmark sets (autoregressive, float32), token ids saved.
import json, sys, torch, heterospec
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
eng = heterospec.Engine.from_pretrained()
out = []
for s in ["mtbench", "humaneval", "gsm", "alpaca", "cnndm"]:
    for p in load_prompts(s, n=n):
        ids = eng._encode(p.text, True)
        r = eng.generate(ids, max_new_tokens=128, method="autoregressive")
        out.append({"set": s, "id": p.id, "prompt": ids, "output": r.token_ids})
        print(s, p.id, len(ids), len(r.token_ids), flush=True)
json.dump(out, open("/tmp/s66/refs.json", "w"))
