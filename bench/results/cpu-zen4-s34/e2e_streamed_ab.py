# End-to-end A/B of the target's streamed layers (models/target.py, StreamedLayer: the layer's
# kernels called without its modules; same bits) on (STREAMED_LAYERS) vs off. Two engines (one
# per setting, each with its own cost model and policy), the setting alternated per prompt, three
# methods, 2 prompts x 5 sets, 96 tokens.
import time, torch, collections
import heterospec.models.target as TM
from heterospec import Engine
from heterospec.bench import load_prompt_sets
torch.set_num_threads(2)
engines = {on: Engine.from_pretrained() for on in (False, True)}


def generate(on, *a, **k):
    TM.STREAMED_LAYERS = on
    return engines[on].generate(*a, **k)


sets = load_prompt_sets(["mtbench", "humaneval", "gsm", "alpaca", "cnndm"], 2, 0)
ps = [q.text for qs in sets.values() for q in qs]
methods = ["autoregressive", "eagle3", "heterospec"]
for on in (False, True):     # warm-up: each engine's quick cost model, the policy's first rounds
    for m in methods:
        generate(on, "Tell me about the history of the bicycle.", max_new_tokens=48, method=m)
tt = collections.defaultdict(float); nt = collections.defaultdict(int); outs = {}
for i, p in enumerate(ps):
    for on in ((False, True) if i % 2 == 0 else (True, False)):
        for m in methods:
            t = time.perf_counter(); r = generate(on, p, max_new_tokens=96, method=m); dt = time.perf_counter() - t
            tt[(on, m)] += dt; nt[(on, m)] += r.stats.new_tokens; outs[(i, on, m)] = r.token_ids
    print(i, {f"{'streamed' if k[0] else 'modules'}/{k[1]}": round(nt[k] / tt[k], 1) for k in tt}, flush=True)
for on in (False, True):
    for m in methods[1:]:
        same = sum(outs[(i, on, m)] == outs[(i, on, "autoregressive")] for i in range(len(ps)))
        print(f"{'streamed' if on else 'modules'} {m}: greedy output equal to autoregressive's on {same} / {len(ps)} prompts")
for m in methods:
    same = sum(outs[(i, True, m)] == outs[(i, False, m)] for i in range(len(ps)))
    print(f"{m}: streamed vs modules, equal output on {same} / {len(ps)} prompts")
for m in methods:
    a, b = nt[(False, m)] / tt[(False, m)], nt[(True, m)] / tt[(True, m)]
    print(f"{m:15s} modules {a:6.2f} tok/s  streamed {b:6.2f} tok/s  ratio {b / a:.3f}")
for on in (False, True):
    ar = nt[(on, "autoregressive")] / tt[(on, "autoregressive")]
    print(("streamed" if on else "modules"), " ".join(f"{m} / AR {nt[(on, m)] / tt[(on, m)] / ar:.3f}" for m in methods[1:]))
