"""KVCache.keep_rows times in the batch compactions of two calls each (fifty-first session):
    python bench/results/cpu-amx-s51/keep_rows_timing.py float32 16
"""
import sys, time, warnings, collections
import torch
import heterospec.engine as HE
from heterospec.models.kv_cache import KVCache
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
warnings.simplefilter("ignore")
dtype = sys.argv[1]; B = int(sys.argv[2])
eng = Engine.from_pretrained(device="cpu", dtype=getattr(torch, dtype))
sets = load_prompt_sets(["mtbench", "alpaca"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
log = []
okr = KVCache.keep_rows
def kr(self, rows):
    t = time.perf_counter(); okr(self, rows); log.append(("keep_rows", tuple(self.k.shape), round(1e3 * (time.perf_counter() - t), 1)))
KVCache.keep_rows = kr
odf = HE._Batch.drop_finished
def df(self):
    t = time.perf_counter(); n0 = self.size; odf(self); log.append(("drop", n0, self.size, round(1e3 * (time.perf_counter() - t), 1)))
HE._Batch.drop_finished = df
for m in ("autoregressive", "heterospec", "autoregressive", "heterospec"):
    log.clear(); eng.generate_batch(prompts[:B], max_new_tokens=96, **bench_call(m)); print(m, log)
