"""Context lookup inside vLLM: chains copied from each request's own tokens, priced by vLLM's step costs.

Our engine's context lookup (:mod:`heterospec.lookup`) proposes, for free, the tokens that followed
the latest earlier occurrence of a request's last ``n`` tokens, and a :class:`LookupGate` runs such
a step only where its expected tokens per ms beat the fitted plan. Here the same parts run on
vLLM's steps (no vLLM import in this module, so it is tested without vLLM):

- **Each request's context** (:meth:`LookupSteps.feed`). vLLM's EAGLE proposer runs before the
  runner's bookkeeping of the step, so a request's committed tokens are its prompt and output
  through the previous step (``CachedRequestState``) plus the tokens sampled in this step (the
  rows of ``sampled_token_ids`` that ``prepare_next_token_ids_padded`` receives; rejected
  positions are -1). One :class:`ContextIndex` per running request grows by those; one whose
  length disagrees with the request's (a preemption, a step the proposer did not see) is built
  again from the request. Requests still in a chunked prefill (vLLM's discard mask) propose
  nothing.
- **Earlier requests** (:class:`heterospec.lookup.OutputHistory`). A request whose index leaves
  the running set (it finished, or was preempted) is kept in the history, and every request's
  proposal is the better of its own context's and the history's (``LookupGate.better``), as in
  our engine; never an earlier answer to its own prompt.
- **The lookup corpus** (:mod:`heterospec.datastore`, shipped next to the draft): where a request's
  own context matches fewer than ``CORPUS_BELOW`` tokens, the corpus's chain competes too.
- **The price** (:meth:`LookupSteps.choose`). A lookup step verifies the chosen chains in one
  target step: :class:`StepCosts`'s speculative line at the batch's mean draft tokens, plus the
  draft's warm first forward where the drafter would have run (it keeps the draft's KV cache
  whole: vLLM's draft writes it only in its forwards). It runs instead of the fitted plan's step
  when the gate's expected tokens per ms beat the plan's prediction (a speculative plan) or a
  plain step (a plain plan) by the gate's margin.
- **Learning** (:meth:`LookupSteps.observe`). At the next step vLLM's rejected counts give each
  chain's accepted length (the gate's acceptance per match-length bucket and position), and the
  step's time against the price (the gate's time scale per batch bucket).

vLLM's rejection sampler verifies the chains like any draft, so the output stays vLLM's (greedy:
the target's argmax; sampling: a copied token is a deterministic proposal, accepted by exact match
against vLLM's own sampler).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..lookup import ContextIndex, LookupGate, LookupRound, OutputHistory


class LookupSteps:
    """The running requests' context indices and the gate that decides lookup steps."""

    def __init__(self, kmax: int, history: bool = True, corpus=None, prior: Optional[dict] = None) -> None:
        self.gate = LookupGate(kmax)
        if prior is not None:        # (heterospec.lookup.load_lookup_prior; a saved state replaces it)
            self.gate.seed(prior)
        self.corpus = corpus          # a heterospec.datastore.CorpusIndex, or None
        self._index: Dict[str, ContextIndex] = {}
        self._prompt: Dict[str, Tuple[int, int]] = {}     # per indexed request: its prompt's tokens, key
        self.history: Optional[OutputHistory] = OutputHistory() if history else None
        self._pending: Optional[Tuple[List[str], LookupRound]] = None    # the last lookup step's
        self.steps = 0               # lookup steps run (this process)
        self.rebuilt = 0             # indices built from a request's tokens (first sight, or out of step)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def pending(self) -> bool:
        """Whether the step that just ran was a lookup step (not observed yet)."""
        return self._pending is not None

    def pending_lengths(self) -> Optional[List[int]]:
        """That step's chain lengths, per request (None: it was not a lookup step)."""
        return None if self._pending is None else [len(c) for c in self._pending[1].chains]

    def length(self, req_id: str) -> Optional[int]:
        """Tokens in the index of ``req_id`` (its committed tokens), None without one."""
        idx = self._index.get(req_id)
        return None if idx is None else len(idx)

    def tokens(self, req_id: str) -> Optional[List[int]]:
        """The tokens the index of ``req_id`` holds (None: no index)."""
        idx = self._index.get(req_id)
        return None if idx is None else list(idx.tokens)

    # -- context -----------------------------------------------------------------------------
    def feed(self, req_ids: Sequence[str], sampled: Optional[Sequence[Sequence[int]]],
             discard: Optional[Sequence[bool]], committed: Callable[[str], Optional[Tuple[Sequence[int], Sequence[int]]]],
             vocab_size: int) -> None:
        """This step's committed tokens. ``sampled[i]``: request ``i``'s sampled row (values outside
        ``[0, vocab_size)`` are vLLM's placeholders for rejected positions); ``discard[i]``: its
        tokens are not committed (a chunked prefill); ``committed(req_id)``: its
        ``(prompt_token_ids, output_token_ids)`` through the previous step, or None (no token ids,
        e.g. prompt embeddings). ``sampled`` None: the step's tokens are unknown and every index
        is dropped (rebuilt when next seen)."""
        if sampled is None:
            self._index, self._prompt = {}, {}
            return
        index: Dict[str, ContextIndex] = {}
        for i, rid in enumerate(req_ids):
            if i >= len(sampled) or (discard is not None and discard[i]):
                continue
            got = committed(rid)
            if got is None:
                continue
            prompt, output = got
            idx = self._index.get(rid)
            if idx is None or len(idx) != len(prompt) + len(output):
                idx = ContextIndex(list(prompt) + list(output))
                self._prompt[rid] = (len(prompt), OutputHistory.key(prompt))
                self.rebuilt += 1
            idx.extend([t for t in sampled[i] if 0 <= t < vocab_size])
            index[rid] = idx
        for rid, idx in self._index.items():
            if rid not in index:                # no longer running: its tokens join the history
                n = self._prompt.pop(rid, (0, 0))[0]
                if self.history is not None:
                    self.history.add(idx.tokens[:n], idx.tokens[n:])
        self._index = index

    def proposals(self, req_ids: Sequence[str], limit: int) -> List[tuple]:
        """Per request: ``(chain, match length)`` from its own context, ``(chain, match length,
        True)`` from the history, ``(chain, grade, 2)`` from the corpus, ``([], 0)`` where it has
        no index or no match."""
        out = []
        for rid in req_ids:
            idx = self._index.get(rid)
            if idx is None or limit <= 0:
                out.append(([], 0))
                continue
            history = self.history if self.history is not None and len(self.history) else None
            out.append(self.gate.propose(idx, limit, history, self._prompt.get(rid, (0, None))[1], self.corpus))
        return out

    # -- decision ----------------------------------------------------------------------------
    def choose(self, req_ids: Sequence[str], limit: int, room: Sequence[int], costs, batch_size: int,
               warm_ms: float, alternative) -> Optional[LookupRound]:
        """A lookup step for this batch, or None (the plan's step runs). ``costs``: the
        :class:`StepCosts` (normalized ms); ``warm_ms``: the draft's warm forward the step also
        runs (0: drafter off); ``room``: per request, tokens it may still emit; ``alternative``:
        the plan's tokens per second, or a function returning it (asked only if a chain pays)."""
        proposals = self.proposals(req_ids, limit)
        if not any(p[0] for p in proposals):
            return None
        return self.gate.choose(proposals, lambda mean, most: costs.verify_ms(batch_size, mean) + warm_ms,
                                alternative, room, costs.bucket(batch_size))

    def ran(self, req_ids: Sequence[str], chosen: LookupRound) -> None:
        """The step verifies ``chosen`` (what :meth:`observe` then learns from)."""
        self._pending = (list(req_ids), chosen)
        self.steps += 1

    def forget_step(self) -> None:
        """The step that ran was not a lookup step."""
        self._pending = None

    # -- learning ----------------------------------------------------------------------------
    def observe(self, req_ids: Sequence[str], rejected: Optional[Sequence[int]], seconds: Optional[float]) -> bool:
        """The lookup step before this one, if there was one: what the target accepted of each
        chain (``rejected[i]``: draft tokens vLLM rejected for request ``req_ids[i]`` of this
        step; a request no longer running teaches nothing) and its time (normalized seconds, or
        None). Returns whether the previous step was a lookup step."""
        if self._pending is None:
            return False
        prev_ids, chosen = self._pending
        self._pending = None
        rej = {} if rejected is None else {rid: int(r) for rid, r in zip(req_ids, rejected)}
        chains, accepted = [], []
        for rid, chain in zip(prev_ids, chosen.chains):
            if chain and rid in rej:
                chains.append(chain)
                accepted.append(max(0, min(len(chain), len(chain) - rej[rid])))
            else:
                chains.append([])
                accepted.append(0)
        seen = LookupRound(chains, chosen.buckets, chosen.predicted_ms, chosen.expected_tokens,
                           chosen.model_ms, chosen.batch_bucket)
        self.gate.observe(seen, accepted, seconds)
        return True
