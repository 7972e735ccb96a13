import time, torch, heterospec, sys, collections
from heterospec.bench import load_prompt_sets
from heterospec import policy as PO
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(dtype=torch.bfloat16)
acc = collections.Counter(); cnt = collections.Counter()
orig = PO.FittedPolicy.fitted_plan
def fp(self, batch_size, context=None):
    t0 = time.perf_counter()
    b = self.bucket(batch_size); last = self._last_fit.get(b)
    c = self.context if context is None else self.context_bucket(context)
    s = self.position_scale(); t1 = time.perf_counter()
    t, q = self.time_scale(b), self.plain_scale(b); t2 = time.perf_counter()
    fk = self._as_key("bin_frequencies"); t3 = time.perf_counter()
    gk = self._as_key("bin_scale"); t4 = time.perf_counter()
    key = (b, c, s, t, q, fk, gk); hit = key in self._plans; t5 = time.perf_counter()
    r = orig(self, batch_size, context); t6 = time.perf_counter()
    for k, v in [("position_scale", t1-t0), ("time/plain_scale", t2-t1), ("key freq", t3-t2), ("key scale", t4-t3), ("hash", t5-t4), ("orig total", t6-t5)]:
        acc[k] += v; cnt[k] += 1
    acc["hits"] += hit
    acc["len fk"] += len(str(fk)); acc["len gk"] += len(str(gk))
    return r
PO.FittedPolicy.fitted_plan = fp
sets = load_prompt_sets(["mtbench", "alpaca"], 8)
ps = [p.text for s in sets.values() for p in s]
eng.generate(ps[0], max_new_tokens=16); acc.clear(); cnt.clear()
for p in ps: eng.generate(p, max_new_tokens=96)
n = cnt["hash"]
for k, v in acc.items(): print(f"{k:18s} {1e6*v/n if k not in ('hits','len fk','len gk') else v/n:8.2f}")
