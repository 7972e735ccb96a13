"""An implementation of the target's sampling distribution that shares no code with heterospec.

``reference_probs`` chains transformers' own logits warpers (temperature, then top-k, then
top-p: the order ``transformers.generate`` applies them) in float64 and takes the softmax. The
sampling-law tests build their expected law with it, so a bug in
:func:`heterospec.sampling.processed_probs` (the engine's path) cannot hide in the expected
side of the comparison.
"""

from __future__ import annotations

import torch


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """float64 probabilities ``[..., V]``: softmax of ``logits`` after transformers'
    ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` (``top_k > 0``) and ``TopPLogitsWarper``
    (``top_p < 1``)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    shape = logits.shape
    x = logits.detach().to(torch.float64).reshape(-1, shape[-1]).cpu()
    warpers = [TemperatureLogitsWarper(float(temperature))]
    if top_k > 0:
        warpers.append(TopKLogitsWarper(int(top_k)))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(float(top_p)))
    ids = torch.zeros(x.shape[0], 1, dtype=torch.long)      # unused by these warpers
    for w in warpers:
        x = w(ids, x)
    return torch.softmax(x, dim=-1).reshape(shape)


def chi_square_pvalue(samples, law):
    """Chi-square goodness of fit of ``samples`` (hashable outcomes) to ``law`` (outcome ->
    probability); outcomes expected fewer than 5 times are pooled into one cell. Returns the
    p-value and how many samples fell on outcomes the law gives probability 0."""
    from scipy.stats import chi2

    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    cells = sorted(law, key=lambda c: -law[c])
    stat, dof, pooled_e, pooled_o = 0.0, -1, 0.0, 0
    for c in cells:
        e = law[c] * n
        if e >= 5:
            stat += (counts.get(c, 0) - e) ** 2 / e
            dof += 1
        else:                                   # pool rare sequences into one cell
            pooled_e += e
            pooled_o += counts.get(c, 0)
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        dof += 1
    impossible = sum(v for c, v in counts.items() if law.get(c, 0.0) == 0.0)
    return float(chi2.sf(stat, dof)), impossible
