"""Where HeteroSpec's plain mode loses to autoregressive decoding at a batch size where it does not
speculate (issue 10), interleaved in one process: autoregressive vs HeteroSpec (fitted policy;
with the draft's catch-up window, ``Engine.draft_window``, and without; and with a plain
bucket's probes spaced by the model's predicted loss only, as before the twentieth session) vs
a policy that is always plain but keeps the draft's bookkeeping (taps, pending extend), HeteroSpec
without cold plain steps (``Engine.cold_plain``: every plain step queues the draft's catch-up), and a
scripted plain policy that probes speculation as the fitted one does in a plain bucket (with
and without the window).

    python bench/plain_mode_ab.py [--batch 8] [--draft-dtype float32] [--cases hs hs-warm]
    # 4 MT-bench + 4 Alpaca prompts, 96 tokens, 6 passes; autoregressive is always run
    python bench/plain_mode_ab.py --ledger    # ... and where each case's time goes, by round kind

``--ledger`` times every round (from one round's emitted tokens to the next's, the policy's
Python included) and prices it against autoregressive decoding's steps at the same number of
running requests: a round's *excess* is its time minus what autoregressive steps take for the
tokens it gave each running request. Summed by round kind (plain, speculative, lookup), it says
which kind of round a case loses its time in.
"""
import argparse
import collections
import statistics
import time

import torch

import heterospec
from heterospec.bench import load_prompt_sets, speed_flags
from heterospec.policy import Eagle3Policy, FittedPolicy, Plan, Policy

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--passes", type=int, default=6)
ap.add_argument("--max-new-tokens", type=int, default=96)
ap.add_argument("--batch", type=int, default=8, help="prompts per call: half MT-bench, half Alpaca")
ap.add_argument("--draft-dtype", choices=["float32", "bfloat16"], default=None,
                help="the draft's dtype (default: the engine's choice for this CPU); float32 with "
                     "MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 emulates an AVX2-only CPU")
ap.add_argument("--cases", nargs="+", default=None,
                help="run only these cases (default: all): ar hs hs-warm hs-no-lookup hs-no-window hs-model-priced probing "
                     "probing-no-window plain+draft")
ap.add_argument("--ledger", action="store_true",
                help="also time every round and sum each case's excess over autoregressive steps by round kind")
args = ap.parse_args()
torch.set_num_threads(2)
flags = speed_flags(announce=True)
eng = heterospec.Engine.from_pretrained(device="cpu", dtype=torch.float32,
                                        draft_dtype=getattr(torch, args.draft_dtype) if args.draft_dtype else None)
half = (args.batch + 1) // 2
sets = load_prompt_sets(["mtbench", "alpaca"], half, 0)
prompts = ([p.text for p in sets["mtbench"]] + [p.text for p in sets["alpaca"]])[:args.batch]


class PlainWithDraft(Policy):
    """Always plain, but keeps the draft's bookkeeping (taps, pending extend), as a plain bucket does."""
    def plan(self, b, context=None): return Plan("plain", speculate=False)
    def needs_draft(self, b): return True
    def max_tree_nodes(self, b): return 8


class Probing(Policy):
    """Plain, with a burst of 5 speculative (EAGLE-3) rounds every 64 rounds: what the fitted
    policy does in a bucket where speculation does not pay, whatever it concludes on this box."""
    def __init__(self):
        self.n, self.spec = 0, Eagle3Policy(eng.config).plan(len(prompts))
    def plan(self, b, context=None): return self.spec
    def round_plan(self, b, context=None):
        self.n += 1
        return self.spec if self.n % 64 < 5 and self.n > 5 else Plan("plain", speculate=False)


class ModelPriced(FittedPolicy):
    """The fitted policy as before the twentieth session: a plain bucket's probes spaced by the
    model's predicted loss only (a bucket the guard holds plain probes every 64-256 rounds)."""
    def _measured_probe_loss(self, bucket):
        return 0.0


window = eng.draft_window
# its own online state (in memory), the same tables and cost model as the engine's fitted policy
model_priced = ModelPriced(eng.tables_for(eng.config.top_k), eng.cost_model, eng.config, ragged=eng.ragged_verify)
# name, generate_batch arguments, the engine's draft_window for the run
cases = [("ar", dict(method="autoregressive"), window), ("hs", dict(method="heterospec"), window),
         ("hs-warm", dict(method="heterospec"), window),
         ("hs-no-lookup", dict(method="heterospec", lookup=False), window),
         ("hs-no-window", dict(method="heterospec"), None),
         ("hs-model-priced", dict(method="heterospec", policy=model_priced), window),
         ("probing", dict(method="heterospec", policy=Probing()), window),
         ("probing-no-window", dict(method="heterospec", policy=Probing()), None),
         ("plain+draft", dict(method="heterospec", policy=PlainWithDraft()), window)]
if args.cases:
    unknown = set(args.cases) - {n for n, _, _ in cases}
    if unknown:
        ap.error(f"unknown cases: {sorted(unknown)}")
    cases = [c for c in cases if c[0] in args.cases or c[0] == "ar"]
for name, kw, w in cases:
    eng.draft_window, eng.cold_plain = w, name != "hs-warm"
    eng.generate_batch(prompts, max_new_tokens=8, **kw)
# The draft's catch-up, counted where it happens: time in the draft's extend and the entries it
# computed (the prompt's, at prefill, included), per run. Less noisy than tokens/s on a shared box.
extend, catch_up = eng.draft.extend, [0.0, 0]


def timed_extend(ids, feats, cache, prefix_lens, num_new, hole=None):
    t = time.perf_counter()
    out = extend(ids, feats, cache, prefix_lens, num_new, hole)
    catch_up[0] += time.perf_counter() - t
    catch_up[1] += int(num_new.sum())
    return out


eng.draft.extend = timed_extend

# --ledger: one entry per emitted round: (time, running requests, kind, tokens per running request)
ledger, emit = [], eng._emit


def logged_emit(st, new, max_new_tokens, stream):
    active = st.active()
    recs = st.stats[active[0]].records if active else []
    kind = ("prefill" if len(ledger) == 1 else "step" if not recs else
            "plain" if recs[-1].plain else "lookup" if recs[-1].lookup else "speculative")
    emit(st, new, max_new_tokens, stream)
    ledger.append((time.perf_counter(), len(active), kind, sum(len(new[b]) for b in active) / max(len(active), 1)))


def excess_by_kind(runs_ledgers, ar_step, ar_prefill, by_batch=False):
    """{kind: [rounds, seconds, excess seconds, tokens per running request]} summed over runs
    (kind: (kind, running requests) with ``by_batch``). ar_step: {running requests:
    autoregressive's seconds per step}; a prefill's excess is over autoregressive's prefill."""
    out = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for lg in runs_ledgers:
        for (t0, *_), (t1, n, kind, toks) in zip(lg, lg[1:]):
            if kind == "prefill":
                price = ar_prefill
            else:                   # a batch size autoregressive never ran at: the nearest one
                price = toks * ar_step[n if n in ar_step else min(ar_step, key=lambda m: abs(m - n))]
            o = out[(kind, n) if by_batch else kind]
            o[0] += 1
            o[3] += toks
            o[1] += t1 - t0
            o[2] += (t1 - t0) - price
    return out


if args.ledger:
    eng._emit = logged_emit
ledgers = {n: [] for n, _, _ in cases}
res = {n: [] for n, _, _ in cases}
share = {n: [] for n, _, _ in cases}
for rep in range(args.passes):   # order reversed every other pass
    for name, kw, w in (cases if rep % 2 == 0 else cases[::-1]):
        eng.draft_window, eng.cold_plain = w, name != "hs-warm"
        catch_up[:] = [0.0, 0]
        t0 = time.perf_counter()
        ledger[:] = [(time.perf_counter(), 0, "start", 0.0)]
        out = eng.generate_batch(prompts, max_new_tokens=args.max_new_tokens, **kw)
        dt = time.perf_counter() - t0
        ledgers[name].append(list(ledger))
        res[name].append(sum(len(o.token_ids) for o in out) / dt)
        share[name].append((catch_up[0] / dt, catch_up[1]))
for n, v in res.items():
    print(f"{n:17s} tok/s", [round(x, 1) for x in v], "median", round(statistics.median(v), 1), "ratio",
          round(statistics.median([a / b for a, b in zip(v, res["ar"])]), 3),
          "| draft extend: %.1f %% of the time, %d entries per run" % (
              100 * statistics.median(s for s, _ in share[n]), statistics.median(e for _, e in share[n])))
if args.ledger:
    # autoregressive's median prefill and step time per number of running requests, over all passes
    steps = collections.defaultdict(list)
    for lg in ledgers["ar"]:
        for (t0, *_), (t1, n, kind, _) in zip(lg, lg[1:]):
            steps["prefill" if kind == "prefill" else n].append(t1 - t0)
    ar_prefill = statistics.median(steps.pop("prefill"))
    ar_step = {n: statistics.median(v) for n, v in steps.items()}
    print(f"autoregressive: prefill {1e3 * ar_prefill:.1f} ms; step ms by running requests:",
          {n: round(1e3 * v, 2) for n, v in sorted(ar_step.items())})
    # autoregressive itself is listed too: its excess over its own medians is what a mean of
    # noisy steps costs over their median (the floor every other case's excess is read against)
    for n in res:
        per = len(ledgers[n])
        print(f"{n} per run (rounds, ms, excess ms over autoregressive's steps for the same tokens):")
        for k, (r, s, e, t) in sorted(excess_by_kind(ledgers[n], ar_step, ar_prefill).items()):
            print(f"    {k:12s} {r / per:6.1f} rounds {1e3 * s / per:8.1f} ms  excess {1e3 * e / per:+8.1f} ms"
                  f"  {t / r:.2f} tokens a round")
        for (k, b), (r, s, e, t) in sorted(excess_by_kind(ledgers[n], ar_step, ar_prefill, True).items(),
                                           key=lambda kv: (kv[0][0], -kv[0][1])):
            if k not in ("prefill", "plain"):
                print(f"      {k:12s} at {b:2d} running: {r / per:5.1f} rounds, {1e3 * s / r:6.2f} ms a round, "
                      f"{t / r:.2f} tokens, excess {1e3 * e / per:+7.1f} ms a run")
