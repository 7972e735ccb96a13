"""Prompts for the lookup prior (heterospec calibrate --lookup-prior N --prompts-file ...): requests the
target wrote itself (data/selfchat, the GPU runs' seeds 5 and 6) that no distilled data set answered, so
the lookup corpus (built from the distilled answers) holds no answer to them, checked against every
benchmark set and the calibration split (heterospec.train.disjoint). The ChatterBot turns of
calibrate --held-out are no use here: 853 of 855 were answered in the distilled data, and the corpus
holds the target's greedy answers to them. Usage: python lookup_prior_prompts.py N OUT"""
import glob, json, random, sys
import numpy as np
from safetensors.numpy import load_file
import heterospec
from heterospec.train.disjoint import filter_prompts, reference_sets

n, out = int(sys.argv[1]), sys.argv[2]
seen = set()
for f in glob.glob("data/distill-v*/shard_*.safetensors"):
    s = load_file(f)
    so, pl, tk = s["seq_offsets"], s["prompt_lens"], s["tokens"]
    seen.update(tuple(int(x) for x in tk[so[i]:so[i] + pl[i]]) for i in range(len(pl)))
e = heterospec.Engine.from_pretrained()
texts = []
for f in sorted(glob.glob("data/selfchat/*-gpu.jsonl")):
    texts += [r["text"] for r in map(json.loads, open(f)) if r.get("text")]
texts = [t for t in dict.fromkeys(texts) if tuple(e._encode(t, True)) not in seen]
kept, report = filter_prompts(texts, reference_sets(), text=lambda t: t)
random.Random(0).shuffle(kept)
with open(out, "w") as f:
    for t in kept[:n]:
        f.write(json.dumps({"text": t}) + "\n")
print(json.dumps({"unanswered": len(texts), "disjoint": {k: v for k, v in report.items() if k != "examples"},
                  "written": min(n, len(kept))}))
