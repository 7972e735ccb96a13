"""A/B in one process (issue 10): the fitted policy priced by the cost model of this session
(phases at 64 cached tokens, each timed run after an untimed run of its own phase; plans per
context bucket from 64) vs as before (phases at 256 cached tokens timed interleaved with big
forwards; context buckets from 256), both with fresh online state, against autoregressive.

(The "new" side is not in the shipped code: first `git apply bench/results/cpu-amx-s46/
context_pricing.patch`, keep a copy of the cached cost model measured before it, then
`heterospec costs` with it.)

    python bench/results/cpu-amx-s46/ab_context_pricing.py --old /tmp/s46/old_costs.json
    python bench/results/cpu-amx-s46/ab_context_pricing.py --old /tmp/s46/old_costs.json --batches 1 \
        --sets mtbench humaneval gsm alpaca cnndm --prompts 6 --max-new-tokens 128 --passes 3
    # --old: a cost model file measured by the code before this session (`heterospec costs`)
"""
import argparse, statistics, time, torch, heterospec
from heterospec import costmodel
from heterospec.bench import load_prompt_sets, speed_flags
from heterospec.policy import FittedPolicy
ap = argparse.ArgumentParser()
ap.add_argument("--old", required=True)
ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
ap.add_argument("--sets", nargs="+", default=["mtbench"])
ap.add_argument("--passes", type=int, default=6)
ap.add_argument("--max-new-tokens", type=int, default=96)
args = ap.parse_args()
torch.set_num_threads(2)
speed_flags(announce=True)


class OldBuckets(FittedPolicy):
    @staticmethod
    def context_bucket(context):
        return 1 << max(8, int(max(context, 1) - 1).bit_length())


eng = heterospec.Engine.from_pretrained(device="cpu", dtype=torch.float32)
new_cm = costmodel.CostModel.load(costmodel.cache_path(costmodel.fingerprint(eng)))
old_cm = costmodel.CostModel.load(args.old)
assert new_cm.contexts[0] < old_cm.contexts[0], (new_cm.contexts, old_cm.contexts)
eng.cost_model = new_cm                        # in memory: fresh online state, not persisted
eng_old = heterospec.Engine.from_pretrained(device="cpu", dtype=torch.float32, cost_model=old_cm)
eng_old._policy("heterospec", eng_old.config).__class__ = OldBuckets
sets = load_prompt_sets(args.sets, args.prompts, 0)
prompts = [p.text for s in args.sets for p in sets[s]]
cases = ["ar", "new", "old"]


def run(case, B, n):
    e = eng_old if case == "old" else eng
    method = "autoregressive" if case == "ar" else "heterospec"
    t0, toks, out = time.perf_counter(), 0, []
    for i in range(0, len(prompts), B):
        res = e.generate_batch(prompts[i:i + B], max_new_tokens=n, method=method)
        out += [r.token_ids for r in res]
        toks += sum(len(r.token_ids) for r in res)
        if n == args.max_new_tokens and case != "ar":
            for r in res:
                for rec in r.stats.records:
                    kind = "lookup" if rec.lookup else "plain" if rec.plain else "spec"
                    k = kinds.setdefault((case, B, kind), [0, 0])
                    k[0] += 1
                    k[1] += rec.accept_len
    return out, toks / (time.perf_counter() - t0)


kinds = {}


for c in cases:
    run(c, 1, 8)
rate = {(c, B): [] for c in cases for B in args.batches}
outs = {}
for rep in range(args.passes):
    for B in args.batches:
        for c in (cases if rep % 2 == 0 else cases[::-1]):
            out, r = run(c, B, args.max_new_tokens)
            rate[c, B].append(r)
            outs.setdefault((c, B), out)
    print(f"pass {rep + 1}/{args.passes} done", flush=True)
for (c, B), out in outs.items():
    assert out == outs["ar", B], f"{c} b{B}: greedy output differs from autoregressive"
print("greedy output identical to autoregressive for new and old at every batch size")
print(f"{'batch':>5} {'ar tok/s':>9} {'new/ar':>7} {'old/ar':>7} {'new/old':>8}")
for B in args.batches:
    r = lambda c: statistics.median([a / b for a, b in zip(rate[c, B], rate["ar", B])])
    nr = statistics.median([a / b for a, b in zip(rate["new", B], rate["old", B])])
    print(f"{B:>5} {statistics.median(rate['ar', B]):9.1f} {r('new'):7.3f} {r('old'):7.3f} {nr:8.3f}")
print("request-rounds by kind per pass (mean accepted drafts per round):")
for B in args.batches:
    for c in ("new", "old"):
        print(f"  b{B} {c}: " + ", ".join(f"{kind} {kinds[c, B, kind][0] / args.passes:.0f} ({kinds[c, B, kind][1] / max(kinds[c, B, kind][0], 1):.2f})"
                                         for kind in ("plain", "spec", "lookup") if (c, B, kind) in kinds))
print("online corrections at the end (time scale, plain scale per batch bucket; position scale):")
for c, e in (("new", eng), ("old", eng_old)):
    pol = e._policy("heterospec", e.config)
    print(f"  {c}: " + ", ".join(f"b{B} time {pol.time_scale(FittedPolicy.bucket(B)):.3f} plain {pol.plain_scale(FittedPolicy.bucket(B)):.3f}"
                                 for B in args.batches) + f"; position {[round(x, 3) for x in pol.position_scale()]}")
