"""End to end, in one process: sampled decoding (temperature 0.8, top-p 0.95) with the sample_tokens
op against the composed path it replaced (processed_probs then sample_rows, patched into the
engine), alternating per prompt and method, ABBA; the two variants' texts compared."""
import statistics, sys, time, torch, heterospec
import heterospec.engine as engine_mod
from heterospec import datasets
from heterospec.sampling import draw, draw_rows, processed_probs, sample_at, sample_rows

def composed(logits, params, u):
    return sample_rows(processed_probs(logits, params), u)

def composed_draw(logits, params, u):        # plain steps and prefill (engine._pick)
    return sample_at(processed_probs(logits, params), u)

eng = heterospec.Engine.from_pretrained()
prompts = [p.text for s in ('mtbench', 'humaneval', 'alpaca') for p in datasets.load_prompts(s, n=4)]
n_new = 96
rates = {(m, v): [] for m in ('autoregressive', 'heterospec') for v in ('op', 'composed')}
same = differ = 0
for i, prompt in enumerate(prompts):
    for method in ('autoregressive', 'heterospec'):
        order = ('op', 'composed') if (i % 2 == 0) else ('composed', 'op')
        toks = {}
        for v in order:
            engine_mod.draw_rows = draw_rows if v == 'op' else composed
            engine_mod.draw = draw if v == 'op' else composed_draw
            t = time.perf_counter()
            r = eng.generate(prompt, max_new_tokens=n_new, method=method, temperature=0.8, top_p=0.95, seed=7 + i)
            rates[(method, v)].append(len(r.token_ids) / (time.perf_counter() - t))
            toks[v] = r.token_ids
        same += toks['op'] == toks['composed']
        differ += toks['op'] != toks['composed']
engine_mod.draw_rows, engine_mod.draw = draw_rows, draw
print(f'prompts {len(prompts)} x {n_new} tokens, threads {torch.get_num_threads()}; texts equal {same}, differ {differ}')
for method in ('autoregressive', 'heterospec'):
    op, comp = rates[(method, 'op')], rates[(method, 'composed')]
    ratios = [a / b for a, b in zip(op, comp)]
    print(f'{method}: op {statistics.mean(op):.1f} tok/s, composed {statistics.mean(comp):.1f} tok/s, '
          f'op/composed per prompt: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})')
