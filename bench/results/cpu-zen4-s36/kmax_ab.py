"""Context lookup: the longest chain (kmax 8 vs 16) at batch 1, interleaved per prompt."""
import sys, time, torch, statistics as S
from heterospec.engine import Engine
from heterospec.bench import load_prompt_sets
from heterospec.lookup import LookupGate
torch.set_num_threads(2)
e = Engine.from_pretrained()
sets = load_prompt_sets(["mtbench", "humaneval", "gsm", "alpaca", "cnndm"], int(sys.argv[1]))
gates = {8: LookupGate(kmax=8), 16: LookupGate(kmax=16)}
e.generate("Hello there, how are you?", max_new_tokens=8)
tot = {}
for name, ps in sets.items():
    for i, p in enumerate(ps):
        order = [8, 16] if i % 2 == 0 else [16, 8]
        ref = None
        for k in order + ["ar"]:
            t0 = time.perf_counter()
            if k == "ar":
                r = e.generate(p.text, max_new_tokens=128, method="autoregressive")
            else:
                e.lookup_gate = gates[k]
                r = e.generate(p.text, max_new_tokens=128)
            dt = time.perf_counter() - t0
            ref = ref or r.token_ids
            assert r.token_ids == ref
            a = tot.setdefault((name, k), [0, 0.0, 0]); a[0] += len(r.token_ids); a[1] += dt
            a[2] += sum(x.accept_len + 1 for x in r.stats.records if x.lookup)
for name in sets:
    ar = tot[(name, "ar")]
    print(name, " ".join(f"k{k}: {tot[(name,k)][0]/tot[(name,k)][1]/(ar[0]/ar[1]):.3f}x ({tot[(name,k)][2]} tok via lookup)" for k in (8, 16)))
m8 = S.fmean(tot[(n, 8)][0]/tot[(n, 8)][1] / (tot[(n, "ar")][0]/tot[(n, "ar")][1]) for n in sets)
m16 = S.fmean(tot[(n, 16)][0]/tot[(n, 16)][1] / (tot[(n, "ar")][0]/tot[(n, "ar")][1]) for n in sets)
print(f"mean vs AR: k8 {m8:.3f} k16 {m16:.3f}")
