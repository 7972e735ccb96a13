"""Seeded sampling that does not depend on what was drafted (vLLM, temperature > 0, per-request seeds).

vLLM picks a seeded request's token with one draw of the request's generator (on CPU one seed
for a per-token Gumbel-max, on GPU one exponential vector: ``Sampler.topk_topp_sampler``). Its
rejection sampler draws differently: uniforms for the draft tokens, exponentials for a residual
token, and the bonus token's draw before all of them. So the text a seeded request gets depends
on how many tokens were drafted for it at every step. HeteroSpec drafts per request and per step
from the batch, the entropies and the measured costs, and vLLM forms batches as requests arrive,
so two runs with the same seeds wrote different texts.

Here a seeded request's draft tokens are verified by **exact match**. The token at position
``p`` is the one vLLM's own sampler picks from the target's processed logits at ``p`` with the
request's ``p``-th draw; a draft token is accepted iff it is that token. For a draft that
proposes one token per position (greedy drafting, the only kind the plugin runs) this accepts
with probability ``P(d)``, as rejection sampling does, and every emitted token is an exact
sample of the target's law. It is also the token vLLM's autoregressive decoding emits with the
same seed: the text no longer depends on the draft, the plan or the batch.

Order of draws in a step that drafts ``n`` tokens for a request at position ``p``: positions
``p .. p+n-1`` here (all drafted positions of all such requests in one call of vLLM's sampler),
the bonus token at ``p+n`` by vLLM's sampler from a copy of the generator advanced by ``n``
draws. After a rejection at ``p+j`` the generator is left after draw ``p+j``, where the next
step continues. Installed by :func:`heterospec.vllm_plugin.patch.install`'s
runner hook when HeteroSpec is asked for.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

SAMPLING_EPS = 1e-5      # vLLM's Sampler: temperature below this is greedy
_active = None           # during one RejectionSampler.forward: (real generators, bonus generators, sampler)


def draw_token(sampler, logits: torch.Tensor, generator: torch.Generator) -> int:
    """The token vLLM's ``sampler`` picks from processed logits ``[V]`` with one draw of
    ``generator`` (the generator advances by exactly what one sampled token costs it)."""
    tokens, _ = sampler.topk_topp_sampler(logits.detach().to(torch.float32).reshape(1, -1).clone(),
                                          {0: generator}, None, None)
    return int(tokens.reshape(-1)[0])


def advance(sampler, generator: torch.Generator, n: int, vocab: int, device) -> None:
    """Advance ``generator`` by what ``n`` sampled tokens cost it. vLLM 0.32.0's CPU sampler
    (``TopKTopPSampler.forward_cpu``) draws one 31-bit seed per token for its fused Gumbel-max;
    that draw is repeated here, since running the fused op over the vocabulary only to move
    the generator costs ~0.5 ms a token. Any other sampler is run on blank logits."""
    tks = sampler.topk_topp_sampler
    if getattr(tks.forward, "__func__", None) is type(tks).forward_cpu and not getattr(tks, "use_fp64_gumbel", False):
        for _ in range(n):
            torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long)
        return
    blank = torch.zeros(vocab, dtype=torch.float32, device=device)
    for _ in range(n):
        draw_token(sampler, blank, generator)


def _random(sampling_metadata, i: int) -> bool:
    t = sampling_metadata.temperature
    return t is not None and float(t[i]) >= SAMPLING_EPS


def wrap_forward(original):
    """``RejectionSampler.forward``: for every seeded, random request that drafted, give vLLM's
    bonus sampler a copy of its generator advanced by the draws of its draft positions."""

    @functools.wraps(original)
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        global _active
        gens = sampling_metadata.generators
        if (not gens or sampling_metadata.all_greedy or draft_probs is not None
                or getattr(self, "synthetic_mode", False)):
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        real, bonus = {}, dict(gens)
        for i, g in gens.items():
            n = metadata.num_draft_tokens[i]
            if n == 0 or not _random(sampling_metadata, i):
                continue
            ahead = torch.Generator(device=g.device)
            ahead.set_state(g.get_state())
            advance(self.sampler, ahead, n, logits.shape[-1], logits.device)
            real[i], bonus[i] = g, ahead
        if not real:
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        _active = (real, bonus, self.sampler)
        try:
            return original(self, metadata, draft_probs, logits, dataclasses.replace(sampling_metadata, generators=bonus))
        finally:
            _active = None

    forward._heterospec = True
    return forward


def wrap_rejection_sample(original, placeholder: int):
    """``rejection_sample``: vLLM's kernels for every other request; exact match, position by
    position with the request's own generator, for the requests :func:`wrap_forward` took."""

    @functools.wraps(original)
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs):
        if _active is None:
            return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                            target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
        real, bonus, sampler = _active
        others = {i: g for i, g in sampling_metadata.generators.items() if i not in real}
        out = original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                       target_logits, bonus_token_ids, dataclasses.replace(sampling_metadata, generators=others),
                       *args, **kwargs)
        ends = cu_num_draft_tokens.tolist()
        drafts = draft_token_ids.tolist()
        # Every drafted position of every taken request in one call of vLLM's sampler, rows in
        # position order, so that each request's generator hands its draws out in that order.
        rows, row_gens, spans = [], {}, {}
        for i, g in real.items():
            n = num_draft_tokens[i]
            spans[i] = (len(rows), ends[i] - n, n, g.get_state())
            for j in range(n):
                row_gens[len(rows)] = g
                rows.append(ends[i] - n + j)
        tokens, _ = sampler.topk_topp_sampler(target_logits[rows].to(torch.float32), row_gens, None, None)
        tokens = tokens.reshape(-1).tolist()
        for i, g in real.items():
            first, start, n, state = spans[i]
            out[i].fill_(placeholder)
            for j in range(n):
                out[i, j] = tokens[first + j]
                if tokens[first + j] != drafts[start + j]:
                    g.set_state(state)          # the draws of positions p .. p+j only
                    advance(sampler, g, j + 1, target_logits.shape[-1], target_logits.device)
                    break
            else:
                out[i, n] = bonus_token_ids.reshape(-1)[i]
                g.set_state(bonus[i].get_state())      # after the bonus token's draw
        return out

    rejection_sample._heterospec = True
    return rejection_sample
