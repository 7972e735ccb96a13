import json, torch, heterospec
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
ps = json.load(open('/tmp/s69/vllm-b1/prompts.json'))
for d in (1, 2):
    cfg = heterospec.SpecConfig(top_k=1, depth=d, total_tokens=d)
    reach = [0] * (d + 1); acc = [0] * (d + 1); toks = []
    for p in ps:
        r = eng.generate(p, max_new_tokens=128, method="eagle3", config=cfg)
        toks.append(r.token_ids)
        for rec in r.stats.records:
            a = rec.accept_len
            for j in range(1, d + 1):
                if a >= j - 1: reach[j] += 1; acc[j] += a >= j
    print(f"chain of {d}:", [f"pos {j}: {acc[j]}/{reach[j]} = {acc[j]/reach[j]:.3f}" for j in range(1, d + 1)])
json.dump(toks, open('/tmp/s69/ours_tokens.json', 'w'))
