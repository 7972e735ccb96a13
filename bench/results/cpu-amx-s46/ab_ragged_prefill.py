"""A/B in one process: autoregressive decoding with the prefill ragged (the linear layers on the
prompts' real tokens, this session) vs padded to the longest prompt (before). Autoregressive
decoding verifies nothing, so ``Engine.ragged_verify`` switches only its prefill.

    python bench/results/cpu-amx-s46/ab_ragged_prefill.py [--passes 4]
"""
import argparse, statistics, time, torch, heterospec
from heterospec.bench import load_prompt_sets, speed_flags
ap = argparse.ArgumentParser()
ap.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8, 16])
ap.add_argument("--passes", type=int, default=4)
ap.add_argument("--max-new-tokens", type=int, default=96)
args = ap.parse_args()
torch.set_num_threads(2)
speed_flags(announce=True)
eng = heterospec.Engine.from_pretrained(device="cpu", dtype=torch.float32)
prompts = [p.text for p in load_prompt_sets(["mtbench"], max(args.batches), 0)["mtbench"]]
rate = {(r, B): [] for r in (True, False) for B in args.batches}
outs = {}
eng.generate_batch(prompts[:2], max_new_tokens=8, method="autoregressive")
for rep in range(args.passes):
    for B in args.batches:
        for ragged in ((True, False) if rep % 2 == 0 else (False, True)):
            eng.ragged_verify = ragged
            t0 = time.perf_counter()
            res = eng.generate_batch(prompts[:B], max_new_tokens=args.max_new_tokens, method="autoregressive")
            rate[ragged, B].append(sum(len(r.token_ids) for r in res) / (time.perf_counter() - t0))
            outs.setdefault((ragged, B), [r.token_ids for r in res])
for B in args.batches:
    assert outs[True, B] == outs[False, B], f"b{B}: ragged prefill changed the output"
print("greedy output identical with the prefill ragged and padded")
print(f"{'batch':>5} {'padded tok/s':>12} {'ragged tok/s':>12} {'ragged/padded':>13}")
for B in args.batches:
    ratio = statistics.median([a / b for a, b in zip(rate[True, B], rate[False, B])])
    print(f"{B:>5} {statistics.median(rate[False, B]):12.1f} {statistics.median(rate[True, B]):12.1f} {ratio:13.3f}")
