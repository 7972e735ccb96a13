"""Plain-step times by the rows in the batch (53rd session): autoregressive batch-16 calls whose
requests end at EOS at different rounds (prompts cycling), each step's wall time grouped by the
batch's rows after compaction, against fresh calls of that many prompts and the cost model:
    python bench/results/cpu-amx-s53/tail_steps.py float32 6
"""
import sys, time, statistics, collections
import torch
from _setup import benchmark_prompts, engine
dtype, calls = sys.argv[1], int(sys.argv[2])
eng = engine(dtype)
ps = benchmark_prompts()
eng.generate_batch(ps[:2], max_new_tokens=4, method="heterospec")      # loads the cost model
cm = eng.cost_model
by_rows = collections.defaultdict(list)
orig = eng._decode_one
def timed(st, *a, **k):
    t = time.perf_counter(); orig(st, *a, **k)
    by_rows[(st.size, len(st.active()) == st.size)].append(time.perf_counter() - t)
eng._decode_one = timed
for i in range(calls):
    eng.generate_batch([ps[(i * 16 + j) % len(ps)] for j in range(16)], max_new_tokens=96, method="autoregressive")
tail = dict(by_rows)
fresh = {}
for n in sorted({r for r, _ in tail}):
    by_rows.clear()
    for i in range(2):
        eng.generate_batch([ps[(i * n + j) % len(ps)] for j in range(n)], max_new_tokens=24, method="autoregressive")
    fresh[n] = statistics.median(by_rows[(n, True)][1:]) if by_rows[(n, True)][1:] else float("nan")
print("rows  steps  in b16 tails (ms, all running / some riding)   fresh call (ms)   cost model plain_ms")
for n in sorted({r for r, _ in tail}, reverse=True):
    a, b = tail.get((n, True), []), tail.get((n, False), [])
    print("%4d %6d   %8.1f / %8.1f   %8.1f   %8.1f" % (n, len(a) + len(b), 1e3 * statistics.median(a) if a else float("nan"),
          1e3 * statistics.median(b) if b else float("nan"), 1e3 * fresh[n], cm.plain_ms(n)))
