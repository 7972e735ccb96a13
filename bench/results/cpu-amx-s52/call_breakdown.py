"""(52nd session: more phases wrapped.) Where a batch-B call spends its time outside the target steps, AR against heterospec (fifty-first session):
    python bench/results/cpu-amx-s51/call_breakdown.py float32 16
"""
import sys, time, collections
import heterospec.engine as HE, heterospec.lookup as HL, heterospec.policy as HP
from heterospec.bench import bench_call
from _setup import benchmark_prompts, engine
dtype = sys.argv[1]; B = int(sys.argv[2])
eng = engine(dtype)
prompts = benchmark_prompts()
acc = collections.defaultdict(float)
def wrap(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[f"{cls.__name__}.{name}"] += time.perf_counter() - t; return r
    setattr(cls, name, g)
wrap(HL.OutputHistory, "add"); wrap(HP.FittedPolicy, "save_state"); wrap(HL.LookupGate, "save"); wrap(HE.Engine, "_prefill")
wrap(HE.Engine, "_decode_one"); wrap(HE.Engine, "_lookup_choice"); wrap(HP.FittedPolicy, "round_plan"); wrap(HP.FittedPolicy, "observe")
wrap(HL.LookupGate, "observe_plain"); wrap(HE._Batch, "drop_finished"); wrap(HE.Engine, "_round_seconds")
wrap(HL.ContextIndex, "__init__"); wrap(HP.FittedPolicy, "needs_draft"); wrap(HP.FittedPolicy, "new_requests")
wrap(HE.Engine, "_graph_one_offs"); wrap(HP.FittedPolicy, "plain_rounds_ahead"); wrap(HP._MemoCost, "plain_ms")
wrap(HE.Engine, "_policy"); wrap(HE.Engine, "tables_for"); wrap(HP.FittedPolicy, "plan")
wrap(HP.FittedPolicy, "max_tree_nodes"); wrap(HE.Engine, "_encode"); wrap(HE._Batch, "active"); wrap(HE.Engine, "_emit")
_p = HE._progress
def _prog(*a, **k):
    t = time.perf_counter(); r = _p(*a, **k); acc["_progress"] += time.perf_counter() - t; return r
HE._progress = _prog
for m in ("autoregressive", "heterospec"): eng.generate_batch(prompts[:B], max_new_tokens=96, **bench_call(m))
for m in ("autoregressive", "heterospec"):
    acc.clear(); walls = []
    nonplain = []
    for _ in range(3):
        t = time.perf_counter(); res = eng.generate_batch(prompts[:B], max_new_tokens=96, **bench_call(m)); walls.append(time.perf_counter() - t)
        nonplain.append(sum(not r.plain for x in res for r in x.stats.records) if m != "autoregressive" else 0)
    w = sum(walls) / 3
    print(m, "wall %.4f" % w, {k: round(v / 3 * 1e3, 1) for k, v in acc.items()}, "rest ms %.1f" % (1e3 * (w - (acc["Engine._prefill"] + acc["Engine._decode_one"]) / 3)), "non-plain rounds per call", nonplain)
