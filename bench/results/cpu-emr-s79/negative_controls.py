"""The power design of tests/test_sampling_lossless.py (16,000 requests, 2 tokens, noisy oracle
draft, heterospec, temperature 1) unbiased and under each bias of its negative controls: the
chi-square p-value and how many requests' samples differ from the unbiased run's (the unbiased
heterospec run is autoregressive sampling's, token for token). Run from the repository root."""
import os
import sys

sys.path.insert(0, os.getcwd())
import tests.test_sampling_lossless as T  # noqa: E402
from tests.sampling_ref import chi_square_pvalue  # noqa: E402


class Patch:
    def __init__(self):
        self.undo = []

    def setattr(self, obj, name, val):
        self.undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, val)

    def restore(self):
        for obj, name, val in reversed(self.undo):
            setattr(obj, name, val)


res, law = T._power_run()
print("unbiased p = %.2e" % chi_square_pvalue([tuple(r.token_ids) for r in res], law)[0])
for kind in ("uniforms*0.95", "tree keys -1", "accept*1.05"):
    patch = Patch()
    T._biased(patch, kind)
    biased, _ = T._power_run()
    patch.restore()
    print(f"{kind}: p = {chi_square_pvalue([tuple(r.token_ids) for r in biased], law)[0]:.2e}, "
          f"{sum(a.token_ids != b.token_ids for a, b in zip(biased, res))} of {len(res)} requests differ")
