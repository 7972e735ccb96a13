"""Where a batch-B call spends its time outside the target steps, AR against heterospec (fifty-first session):
    python bench/results/cpu-amx-s51/call_breakdown.py float32 16
"""
import sys, time, warnings, collections, statistics
import torch
import heterospec.engine as HE, heterospec.lookup as HL, heterospec.policy as HP
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
warnings.simplefilter("ignore")
dtype = sys.argv[1]; B = int(sys.argv[2])
eng = Engine.from_pretrained(device="cpu", dtype=getattr(torch, dtype))
sets = load_prompt_sets(["mtbench", "alpaca"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
acc = collections.defaultdict(float)
def wrap(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[f"{cls.__name__}.{name}"] += time.perf_counter() - t; return r
    setattr(cls, name, g)
wrap(HL.OutputHistory, "add"); wrap(HP.FittedPolicy, "save_state"); wrap(HL.LookupGate, "save"); wrap(HE.Engine, "_prefill")
wrap(HE.Engine, "_decode_one"); wrap(HE.Engine, "_lookup_choice"); wrap(HP.FittedPolicy, "round_plan"); wrap(HP.FittedPolicy, "observe")
wrap(HL.LookupGate, "observe_plain"); wrap(HE._Batch, "drop_finished"); wrap(HE.Engine, "_round_seconds")
for m in ("autoregressive", "heterospec"): eng.generate_batch(prompts[:B], max_new_tokens=96, **bench_call(m))
for m in ("autoregressive", "heterospec"):
    acc.clear(); walls = []
    for _ in range(3):
        t = time.perf_counter(); eng.generate_batch(prompts[:B], max_new_tokens=96, **bench_call(m)); walls.append(time.perf_counter() - t)
    w = sum(walls) / 3
    print(m, "wall %.4f" % w, {k: round(v / 3 * 1e3, 1) for k, v in acc.items()}, "rest ms %.1f" % (1e3 * (w - (acc["Engine._prefill"] + acc["Engine._decode_one"]) / 3)))
