"""Would a draft with Q4_1 weights (0.75 bytes a weight against Q8_0's 1.25) pay? eagle3 at the
CPU tree with the shipped draft rounded to Q8_0 (as the engine runs it here) against the same
draft rounded further to Q4_1 values (tests/reference's GGUF quantiser), two engines in one
process, per prompt back to back: tau, draft ms per round, tok/s, and the same tokens."""
import sys, time
import torch
sys.path.insert(0, "tests")
from reference import quantize_q4_1_ref
from heterospec import Engine
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
a = Engine.from_pretrained(draft_dtype="q8_0")
b = Engine.from_pretrained(draft_dtype="q8_0")
with torch.no_grad():
    for mod in b.draft.modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.shape[1] % 32 == 0:
            mod.weight.copy_(quantize_q4_1_ref(mod.weight)[0])
sets = sys.argv[1:] or ["mtbench", "alpaca", "humaneval"]
prompts = [(s, p.text) for s in sets for p in load_prompts(s, n=3)]
for e in (a, b): e.generate(prompts[0][1], max_new_tokens=8, method="eagle3")
acc = {k: [0.0, 0, 0, 0.0, 0] for k in ("q8_0", "q4_1")}   # seconds, tokens, rounds, draft s, accepted
for i, (s, p) in enumerate(prompts):
    for name, e in ((("q8_0", a), ("q4_1", b)) if i % 2 == 0 else (("q4_1", b), ("q8_0", a))):
        r = e.generate(p, max_new_tokens=128, method="eagle3")
        st = r.stats
        acc[name][0] += st.total_s; acc[name][1] += st.new_tokens; acc[name][2] += st.rounds
        acc[name][3] += sum(x.draft_s for x in st.records); acc[name][4] += sum(x.accept_len for x in st.records)
for name, (t, n, rounds, ds, accepted) in acc.items():
    print("%s: tok/s %.1f, tau %.3f, draft %.2f ms/round" % (name, n / t, 1 + accepted / rounds, 1e3 * ds / rounds))
