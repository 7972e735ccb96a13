"""How the lookup gate's asks end at batch B (float32 heterospec): taken, near miss (resets the
back-off), clear decline, or no chain at all (the slowest request held the batch). Measurement only."""
import sys, collections, torch, heterospec
from heterospec.bench import load_prompt_sets
from heterospec import lookup
torch.set_num_threads(2)
B = int(sys.argv[1]); n = int(sys.argv[2])
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
outcome = collections.Counter(); due = collections.Counter()
f_ans, f_due = lookup.LookupGate.answered, lookup.LookupGate.due
def answered(self, bucket, taken):
    outcome["taken" if taken else "near miss" if self.near_miss else "declined"] += 1
    return f_ans(self, bucket, taken)
def is_due(self, bucket=1):
    d = f_due(self, bucket); due[d] += 1; return d
lookup.LookupGate.answered, lookup.LookupGate.due = answered, is_due
ps = [p.text for s in load_prompt_sets(["mtbench", "alpaca"], n // 2).values() for p in s]
for i in range(0, len(ps), B):
    eng.generate_batch(ps[i:i + B], max_new_tokens=96, method="heterospec")
print(f"batch {B}: rounds asked {due[True]}, skipped {due[False]}; outcomes {dict(outcome)}")
