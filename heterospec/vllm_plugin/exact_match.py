"""Exact-match verification of sampled drafts in vLLM, and seeded requests that write the text
vLLM autoregressive writes for their seed (temperature > 0).

vLLM picks a sampling request's token with one draw (on CPU one seed for a per-token Gumbel-max,
on GPU one exponential vector: ``Sampler.topk_topp_sampler``), from the request's own generator
when it has a seed. Its rejection sampler draws differently: uniforms for the draft tokens,
exponentials over the whole vocabulary for a residual token, and the bonus token's draw before
all of them. So the text a seeded request gets depends on how many tokens were drafted for it
at every step. HeteroSpec drafts per request and per step from the batch, the entropies and the
measured costs, and vLLM forms batches as requests arrive, so two runs with the same seeds wrote
different texts. On CPU the residual's exponentials (``torch.exponential_`` over batch x
vocabulary floats) are also most of the rejection sampler's time (bench/RESULTS.md).

Here every draft token of a sampling step is verified by **exact match**. The token at position
``p`` is the one vLLM's own sampler picks from the target's processed logits at ``p`` (with the
request's ``p``-th draw when it has a seed); a draft token is accepted iff it is that token. A
greedy request's token is the target's argmax, as in vLLM's greedy kernel. For a draft that
proposes one token per position (greedy drafting, the only kind the plugin runs) exact match
accepts with probability ``P(d)``, as rejection sampling does, and every emitted token is an
exact sample of the target's law. For a seeded request it is also the token vLLM's
autoregressive decoding emits with the same seed: the text no longer depends on the draft, the
plan or the batch.

Order of draws in a step that drafts ``n`` tokens for a seeded request at position ``p``:
positions ``p .. p+n-1`` here (all drafted positions of the step in one call of vLLM's sampler),
the bonus token at ``p+n`` by vLLM's sampler from a copy of the generator advanced by ``n``
draws. After a rejection at ``p+j`` the generator is left after draw ``p+j``, where the next
step continues. Installed by :func:`heterospec.vllm_plugin.patch.verify_by_exact_match` when
HeteroSpec is asked for; an all-greedy step keeps vLLM's own kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..sampling import greedy_tokens

SAMPLING_EPS = 1e-5      # vLLM's Sampler: temperature below this is greedy
_active = None           # during one RejectionSampler.forward: (real generators, bonus generators, sampler, sampling)


def draw_token(sampler, logits: torch.Tensor, generator: torch.Generator) -> int:
    """The token vLLM's ``sampler`` picks from processed logits ``[V]`` with one draw of
    ``generator`` (the generator advances by exactly what one sampled token costs it)."""
    tokens, _ = sampler.topk_topp_sampler(logits.detach().to(torch.float32).reshape(1, -1).clone(),
                                          {0: generator}, None, None)
    return int(tokens.reshape(-1)[0])


def advance(sampler, generator: torch.Generator, n: int, vocab: int, device) -> None:
    """Advance ``generator`` by what ``n`` sampled tokens cost it. vLLM 0.32.0's CPU sampler
    (``TopKTopPSampler.forward_cpu``) draws one 31-bit seed per token for its fused Gumbel-max;
    that draw is repeated here, since running the fused op over the whole vocabulary only to
    move the generator would cost as much as sampling the token. Any other sampler is run on
    blank logits."""
    tks = sampler.topk_topp_sampler
    cpu = getattr(type(tks), "forward_cpu", None)
    if cpu is not None and getattr(tks.forward, "__func__", None) is cpu and not getattr(tks, "use_fp64_gumbel", False):
        for _ in range(n):
            torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long)
        return
    blank = torch.zeros(vocab, dtype=torch.float32, device=device)
    for _ in range(n):
        draw_token(sampler, blank, generator)


def _sampling(sampling_metadata, batch: int) -> list:
    """Per request: does it sample (temperature >= vLLM's epsilon), read with one host copy."""
    t = sampling_metadata.temperature
    return [False] * batch if t is None else [x >= SAMPLING_EPS for x in t[:batch].tolist()]


def wrap_forward(original):
    """``RejectionSampler.forward``: where any request samples, verify the step by exact match
    (:func:`wrap_rejection_sample`); every seeded, sampling request that drafted gives vLLM's
    bonus sampler a copy of its generator advanced by the draws of its draft positions."""

    @functools.wraps(original)
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        global _active
        if sampling_metadata.all_greedy or draft_probs is not None or getattr(self, "synthetic_mode", False):
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        real, bonus = {}, dict(sampling_metadata.generators)
        sampling = _sampling(sampling_metadata, len(metadata.num_draft_tokens))
        for i, g in sampling_metadata.generators.items():
            n = metadata.num_draft_tokens[i]
            if n == 0 or not sampling[i]:
                continue
            ahead = torch.Generator(device=g.device)
            ahead.set_state(g.get_state())
            advance(self.sampler, ahead, n, logits.shape[-1], logits.device)
            real[i], bonus[i] = g, ahead
        _active = (real, bonus, self.sampler, sampling)
        try:
            return original(self, metadata, draft_probs, logits, dataclasses.replace(sampling_metadata, generators=bonus))
        finally:
            _active = None

    forward._heterospec = True
    return forward


def wrap_rejection_sample(original, placeholder: int):
    """``rejection_sample`` inside :func:`wrap_forward`: exact match for every request. A greedy
    request's tokens are the target's argmax (as vLLM's greedy kernel has them); a sampling
    request's are drawn by vLLM's sampler, all drafted positions of the step in one call (rows
    in position order, so that each seeded request's generator hands its draws out in that
    order; requests without a seed draw from the global generator, as vLLM's sampler does)."""

    @functools.wraps(original)
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs):
        if _active is None:
            return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                            target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
        real, bonus, sampler, sampling = _active
        batch = len(num_draft_tokens)
        ends = cu_num_draft_tokens.tolist()
        drafts = draft_token_ids.tolist()
        # the target's token at every drafted position
        rows, row_gens, states = [], {}, {}
        for i in range(batch):
            if sampling[i] and num_draft_tokens[i]:
                if i in real:
                    states[i] = real[i].get_state()
                for j in range(ends[i] - num_draft_tokens[i], ends[i]):
                    if i in real:
                        row_gens[len(rows)] = real[i]
                    rows.append(j)
        drawn = iter([])
        if rows:
            tokens, _ = sampler.topk_topp_sampler(target_logits[rows].to(torch.float32), row_gens, None, None)
            drawn = iter(tokens.reshape(-1).tolist())
        greedy = greedy_tokens(target_logits).tolist() if not all(sampling) else None
        out = [[placeholder] * (max_spec_len + 1) for _ in range(batch)]
        bonus_ids = bonus_token_ids.reshape(-1).tolist()
        for i in range(batch):
            n, start = num_draft_tokens[i], ends[i] - num_draft_tokens[i]
            target = [next(drawn) for _ in range(n)] if sampling[i] else greedy[start:start + n]
            kept = n
            for j in range(n):
                if target[j] != drafts[start + j]:
                    kept = j
                    break
            row = target[:kept + 1] if kept < n else target + [bonus_ids[i]]
            out[i][:len(row)] = row
            if i in real:
                if kept < n:                 # the draws of positions p .. p+kept only
                    real[i].set_state(states[i])
                    advance(sampler, real[i], kept + 1, target_logits.shape[-1], target_logits.device)
                else:                        # after the bonus token's draw
                    real[i].set_state(bonus[i].get_state())
        return torch.tensor(out, dtype=torch.int32, device=target_logits.device)     # one copy to the device

    rejection_sample._heterospec = True
    return rejection_sample
