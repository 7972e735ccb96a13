"""p-values of the sampling-law test (tests/test_sampling_lossless.py, 6,000 requests, 3 tokens,
temperature 1) for autoregressive sampling with keyed draws, over 60 seeds: an exact sampler's
p-values are uniform. Run from the repository root: python bench/results/cpu-emr-s79/keyed_law_seeds.py"""
import os, sys
sys.path.insert(0, os.getcwd())
from tests.test_sampling_lossless import _engine, exact_law, PROMPT
from tests.sampling_ref import chi_square_pvalue
from heterospec.config import SamplingParams
engine, hf = _engine("eagle3")
law = exact_law(hf, SamplingParams(temperature=1.0), new=3)
ps = []
for s in range(100, 160):
    res = engine.generate_batch([PROMPT] * 6000, max_new_tokens=3, method="autoregressive", temperature=1.0, seed=s, chat=False)
    ps.append(chi_square_pvalue([tuple(r.token_ids) for r in res], law)[0])
ps.sort(); n = len(ps)
print('min', ps[:5]); print('deciles', [sum(p < q for p in ps) for q in (0.1, 0.2, 0.5, 0.8, 0.9)])
print('KS D', max(max(abs(p - i / n), abs(p - (i + 1) / n)) for i, p in enumerate(ps)), '(5% crit ~', 1.36 / n ** 0.5, ')')
