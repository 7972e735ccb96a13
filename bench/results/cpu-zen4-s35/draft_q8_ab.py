"""The draft's linears rounded to Q8_0 values (streamed as codes, 1.25 bytes a weight instead of
float16's 2) vs as shipped, two engines interleaved per prompt: a K=1 chain, eagle3 and
autoregressive (the control). Run from the repository root:
python bench/results/cpu-zen4-s35/draft_q8_ab.py [passes]   (draft_q8_ab.txt: 1 pass)"""
import statistics, sys, time, torch
sys.path.insert(0, "tests/reference")
from linear_ref import quantize_q8_0_ref
import heterospec
from heterospec.config import SpecConfig
from heterospec.bench import load_prompt_sets, speed_flags
from heterospec.models.linear import tune_linears, block_codes, TunedLinear
torch.set_num_threads(2)
speed_flags(announce=True)
base = heterospec.Engine.from_pretrained(device="cpu", dtype=torch.float32)
q8 = heterospec.Engine.from_pretrained(device="cpu", dtype=torch.float32)
with torch.no_grad():
    for name, mod in q8.draft.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.weight.copy_(quantize_q8_0_ref(mod.weight)[0])
tune_linears([q8.draft])
print({n: (block_codes(m) or ("-",))[0] for n, m in q8.draft.named_modules() if isinstance(m, TunedLinear)})
sets = load_prompt_sets(["mtbench", "humaneval", "gsm", "alpaca", "cnndm"], 2, 0)
prompts = [p.text for s in sets.values() for p in s]
engines = {"shipped": base, "q8": q8}
cases = {"k1": dict(method="eagle3", config=SpecConfig(top_k=1, depth=0, total_tokens=2)),
         "eagle3": dict(method="eagle3"), "ar": dict(method="autoregressive")}
for eng in engines.values():
    for kw in cases.values():
        eng.generate(prompts[0], max_new_tokens=8, **kw)
tok = {(e, c): [] for e in engines for c in cases}; tau = {(e, c): [] for e in engines for c in cases}
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1):
    for c, kw in cases.items():
        for i, p in enumerate(prompts):
            order = list(engines.items()) if (rep + i) % 2 == 0 else list(engines.items())[::-1]
            for name, eng in order:
                t0 = time.perf_counter(); out = eng.generate(p, max_new_tokens=96, **kw)
                tok[(name, c)].append((len(out.token_ids), time.perf_counter() - t0)); tau[(name, c)].append(out.stats.tau)
for c in cases:
    r = {e: sum(n for n, _ in tok[(e, c)]) / sum(t for _, t in tok[(e, c)]) for e in engines}
    print(f"{c:7s} shipped {r['shipped']:6.2f} tok/s tau {statistics.mean(tau[('shipped', c)]):.3f} | q8 {r['q8']:6.2f} tok/s tau {statistics.mean(tau[('q8', c)]):.3f} | q8/shipped {r['q8']/r['shipped']:.3f}x")
