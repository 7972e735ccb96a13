"""(Run as recorded from /tmp: it needs the old gate beside the new one, made with
``mkdir -p /tmp/s45/old && git show 3540797:heterospec/lookup.py | sed 's/^from \.\([a-z_]*\) import/from heterospec.\1 import/' > /tmp/s45/old/old_lookup.py``.)

A/B in one process: the gate and guard valued by the slowest request (new) vs by the mean of
the requests behind (old, HEAD's LookupGate.choose and _progress)."""
import argparse, statistics, sys, time, torch, heterospec
import heterospec.engine as E
from heterospec.bench import load_prompt_sets, speed_flags
from heterospec.lookup import LookupGate
sys.path.insert(0, "/tmp/s45/old")
import old_lookup
ap = argparse.ArgumentParser(); ap.add_argument("--batch", type=int, default=8); ap.add_argument("--passes", type=int, default=8)
ap.add_argument("--sets", nargs="+", default=["mtbench", "alpaca"]); ap.add_argument("--max-new-tokens", type=int, default=96)
args = ap.parse_args()
torch.set_num_threads(2)
speed_flags(announce=True)
eng = heterospec.Engine.from_pretrained(device="cpu", dtype=torch.float32)
per = (args.batch + len(args.sets) - 1) // len(args.sets)
sets = load_prompt_sets(args.sets, per, 0)
prompts = [p.text for s in args.sets for p in sets[s]][:args.batch]

class OldGate(LookupGate):
    def choose(self, proposals, verify_ms, alt, room=None, batch_bucket=1, lead=None):
        if lead is None:
            return old_lookup.LookupGate.choose(self, proposals, verify_ms, alt, room, batch_bucket)
        props = [p if l == 0 else ([], 0) for p, l in zip(proposals, lead)]
        return old_lookup.LookupGate.choose(self, props, verify_ms, alt, room, batch_bucket,
                                            [1.0 if l == 0 else 0.0 for l in lead])

def old_progress(st, behind, before):
    return sum(len(st.outputs[b]) - before for b in behind) / len(behind)

eng_old = heterospec.Engine.from_pretrained(device="cpu", dtype=torch.float32)
eng_old.lookup_gate = OldGate()
cases = ["ar", "new", "old"]
def run(name, n):
    E._progress = old_progress if name == "old" else E_progress
    e = eng_old if name == "old" else eng
    t0 = time.perf_counter()
    out = e.generate_batch(prompts, max_new_tokens=n, method="autoregressive" if name == "ar" else "heterospec")
    return out, time.perf_counter() - t0
E_progress = E._progress
for c in cases: run(c, 8)
res = {c: [] for c in cases}; info = {c: [] for c in cases}
ref = None
for rep in range(args.passes):
    for c in (cases if rep % 2 == 0 else cases[::-1]):
        out, dt = run(c, args.max_new_tokens)
        res[c].append(sum(len(o.token_ids) for o in out) / dt)
        recs = [r for o in out for r in o.stats.records]
        rounds = max(len(o.stats.records) for o in out) if c != "ar" else 0
        info[c].append((sum(r.lookup for r in recs), sum(not r.plain and not r.lookup for r in recs), rounds))
        toks = [o.token_ids for o in out]
        if c == "ar": ref = toks
        elif ref is not None: assert toks == ref, f"{c}: greedy output differs from autoregressive"
for c in cases:
    print(f"{c:4s} tok/s median {statistics.median(res[c]):6.1f} ratio {statistics.median([a / b for a, b in zip(res[c], res['ar'])]):.3f}"
          f" | per call: lookup request-rounds {statistics.mean(i[0] for i in info[c]):.1f}, speculative {statistics.mean(i[1] for i in info[c]):.1f}, rounds of the longest {statistics.mean(i[2] for i in info[c]):.1f}")
