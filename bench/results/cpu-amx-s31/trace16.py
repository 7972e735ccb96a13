import time, torch
from heterospec import Engine
from heterospec.bench import load_prompt_sets
from heterospec.policy import FittedPolicy
torch.set_num_threads(2)
eng = Engine.from_pretrained()
sets = load_prompt_sets(["mtbench", "alpaca"], 8, 0)
ps = [q.text for qs in sets.values() for q in qs][:16]
eng.generate_batch(ps[:2], max_new_tokens=2, method="heterospec")
log = []
orig = FittedPolicy.round_plan
def rp(self, bs, ctx=None):
    p = orig(self, bs, ctx); log.append((bs, p.speculate)); return p
FittedPolicy.round_plan = rp
for rep in range(2):
    log.clear(); t = time.perf_counter()
    r = eng.generate_batch(ps, max_new_tokens=48, method="heterospec")
    print("%.2fs" % (time.perf_counter() - t), "prefill %.2f" % r[0].stats.prefill_s, "".join("S" if s else "." for _, s in log), flush=True)
