"""AR greedy outputs on the five sets (prompt ids + response ids) for offline lookup analysis."""
import json, sys, torch
from heterospec.engine import Engine
from heterospec.bench import load_prompt_sets
torch.set_num_threads(2)
n = int(sys.argv[1]); T = int(sys.argv[2])
eng = Engine.from_pretrained()
sets = load_prompt_sets(["mtbench", "humaneval", "gsm", "alpaca", "cnndm"], n)
out = []
from tqdm import tqdm
for name, ps in sets.items():
    for p in tqdm(ps, desc=name):
        ids = eng._encode(p.text, True)
        r = eng.generate(p.text, max_new_tokens=T, method="autoregressive")
        out.append({"set": name, "prompt": ids, "resp": r.token_ids})
json.dump(out, open(f"ar_{n}_{T}.json", "w"))
