"""Where vLLM's speculative engines part from vLLM autoregressive in bfloat16, and the top-2 logprobs there.
`python ties.py DIR` (DIR: run.sh's output, its .jsonl files plain or gzipped)."""
import gzip, json, os, sys
d = sys.argv[1]


def first(name):
    p = f"{d}/{name}.jsonl"
    f = open(p) if os.path.exists(p) else gzip.open(p + ".gz", "rt")
    return json.loads(f.readline())


ar = first("autoregressive")
for m in ("eagle3", "heterospec"):
    o = first(m)
    print(m)
    for i, (a, b) in enumerate(zip(ar["token_ids"], o["token_ids"])):
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None:
            print(f"  prompt {i}: same ({len(a)} tokens)"); continue
        la, lb = ar["logprobs"][i][j], o["logprobs"][i][j]
        gap_a = la[0][1] - la[1][1] if len(la) > 1 else None
        gap_b = lb[0][1] - lb[1][1] if len(lb) > 1 else None
        print(f"  prompt {i}: parts at {j}: AR picks {a[j]} top2 {la[:2]} gap {gap_a:.4f}; {m} picks {b[j]} top2 {lb[:2]} gap {gap_b:.4f}")
