"""HeteroSpec as vLLM's EAGLE-3 proposer: per request and per step, how many tokens to draft.

vLLM's :class:`EagleProposer` drafts a chain of ``num_speculative_tokens`` tokens for every
request: one forward over the step's new tokens (it also fills the draft's KV cache), then one
single-token forward per further draft token. :class:`HeteroSpecProposer` keeps that code and
decides, once per step, between the first forward and the loop:

1. **Plain steps.** When the fitted plan for this batch size says speculation does not pay
   (``Plan.speculate`` false), the drafter does not run (except over a prefill) and every
   request gets no draft: the step costs what vLLM's autoregressive step costs. Plain steps
   inside speculation (probes, the guard) run the draft's first forward only (``WARM``, see
   :meth:`HeteroSpecProposer._keep_warm`).
2. **Entropy bins.** Otherwise, after the first forward, each request's Top-K entropy of the
   draft distribution (``torch.ops.heterospec.topk_entropy``, the first node of HeteroSpec's
   meta-path) selects its bin, and the bin's action its draft length ``k`` (0 .. the configured
   ``num_speculative_tokens``). The loop runs until the longest request is done; each request's
   chain is cut to its ``k``. vLLM's scheduler schedules exactly those tokens and vLLM's rejection
   sampler verifies them, so the output is vLLM's.

The per-bin actions come from :class:`heterospec.policy.FittedPolicy` (the policy of our own
engine) with the draft's chain acceptance tables (``acceptance_tables_chain.json``) and a cost
model learned from vLLM's own steps (:class:`StepCosts`). A batch-size bucket is explored first,
cheapest steps first (:meth:`HeteroSpecProposer._explore_plan`), and briefly again every
``REEXPLORE`` steps.

A step whose drafter does not run leaves the draft's KV cache without the entries of that
step's tokens; acceptance stays lower for the rest of those requests. That is why plain steps
are warm wherever the plan may soon draft. The output is unaffected either way: every draft
token is verified by the target.
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Tuple

import torch
from vllm.logger import init_logger
from vllm.v1.spec_decode.eagle import EagleProposer

from .. import ops
from ..config import SpecConfig
from ..policy import FittedPolicy, Plan
from .costs import StepCosts
from .options import HeteroSpecSetupError, default_costs_path, load_chain_tables

logger = init_logger("vllm.heterospec")

REEXPLORE = 256          # steps of a bucket between two short exploration bursts
EXPLORE_PLAIN = 3        # plain steps timed before a bucket drafts at all
EXPLORE_SPEC = 2         # 1-token steps timed before the bound check (their median is the level)
REFIT_EVERY = 32         # timed steps of a bucket between two policy refits
PLAIN, WARM, SPECULATE = 0, 1, 2   # what a step does with the drafter: skip it, first forward only, draft
TRACE_ENV = "HETEROSPEC_VLLM_TRACE"   # a file: one JSON line per step (batch, tokens, times, plan)


class HeteroSpecProposer(EagleProposer):
    """vLLM's EAGLE-3 proposer with HeteroSpec's per-request draft lengths (see the module).

    Instances are vLLM ``EagleProposer`` objects whose class was switched by
    :func:`heterospec.vllm_plugin.patch.install`; :meth:`setup` adds our state."""

    def setup(self, runner, options: dict) -> None:
        from vllm.distributed import get_tp_group
        self.hs_runner = runner
        # With TP the draft's forwards hold collectives, so every rank must run the same loop:
        # the per-request lengths (entropy bins are identical on every rank, the timed plans need
        # not be) come from TP rank 0. None at TP 1.
        group = get_tp_group()
        self.tp_group = group if group.world_size > 1 else None
        spec = self.vllm_config.speculative_config
        self.max_draft = int(spec.num_speculative_tokens)
        self.tables = load_chain_tables(spec.model, options)
        self.learn = options.get("learn", True)
        self.costs_path = options.get("costs") or default_costs_path(self.vllm_config)
        self.costs = StepCosts()
        if os.path.exists(self.costs_path):
            try:
                self.costs = StepCosts.load(self.costs_path)
            except (OSError, ValueError) as e:
                if not self.learn:
                    raise HeteroSpecSetupError(f"HeteroSpec: cannot read the step costs {self.costs_path}: {e}") from None
        elif not self.learn:
            raise HeteroSpecSetupError(f"HeteroSpec: learn=false needs saved step costs, and {self.costs_path} does not "
                                       "exist: run once with learning on (the default), or pass 'costs': PATH")
        self.costs.frozen = not self.learn
        if self.costs.frozen and self.costs.nearest_ready(1) is None:
            raise HeteroSpecSetupError(f"HeteroSpec: {self.costs_path} has no complete bucket to plan with")
        cfg = SpecConfig(top_k=1, depth=max(0, self.max_draft - 1), total_tokens=self.max_draft + 1)
        self.policy = FittedPolicy(self.tables, self.costs, cfg, ragged=True, max_nodes=self.max_draft)
        self.seen: Dict[int, int] = {}               # bucket -> steps seen
        self.planned = set()                          # buckets with a fitted plan
        self.bound_checked = set()                    # buckets whose optimistic plan was fitted
        self.timed_since_fit: Dict[int, int] = {}
        self._step_end: Optional[float] = None        # end of the previous propose call
        self._prev: Dict[str, Tuple[int, int]] = {}   # req id -> (bin, draft tokens) proposed last step
        self._prev_plan: Optional[Plan] = None       # the plan of the previous step (plain too)
        self._prev_draft_ms = 0.0                     # its draft time
        self._decision = None
        self._trace = open(os.environ[TRACE_ENV], "a") if os.environ.get(TRACE_ENV) else None
        logger.info("HeteroSpec: per-request draft lengths 0..%d from %d-bin chain tables (%s); step costs %s (%s)",
                    self.max_draft, len(self.tables.options[0].edges) + 1, self.tables.provenance.get("date", "?"),
                    self.costs_path, "learning" if self.learn else "frozen")

    # -- the plan of this step ---------------------------------------------------------------
    def _explore_plan(self, b: int) -> Optional[Plan]:
        """The plan of an exploration step at bucket ``b``, or None once its costs are known.

        Cheapest first: plain steps (the plain level, free), one step drafting 1 token per
        request (the speculative step's level and the draft's first forward), and only if the
        plan is still worth drafting with the speculative line flat and the draft's loop free (an
        optimistic bound) steps drafting 2 (the slopes of both lines). A bucket where
        speculation cannot pay is therefore settled after one drafting step. Every ``REEXPLORE``
        steps one 1-token step refreshes the low end of the speculative line."""
        if not self.learn:
            return None
        n_plain, n_spec, _, t_ready, d_ready = self.costs.state(b)
        seen = self.seen.get(b, 0)
        if n_plain < EXPLORE_PLAIN:
            return Plan("explore-plain", speculate=False, binned=False)
        if n_spec < EXPLORE_SPEC or (seen >= REEXPLORE and seen % REEXPLORE == 0):
            return self._chain_plan("explore", 1)
        if not (t_ready and d_ready) and self.max_draft >= 2:     # (with K = 1 the slopes never matter)
            if b not in self.bound_checked:
                self.bound_checked.add(b)
                self.policy.refit()
            if self.policy.plan(b).speculate:      # worth drafting even if longer chains were free
                return self._chain_plan("explore", 2)
        return None

    @staticmethod
    def _chain_plan(name: str, k: int) -> Plan:
        """Every request drafts ``k`` tokens (no bins)."""
        return Plan(name, decide_depth=0, entropy_k=4, edges=[], depth=[k - 1], budget=[k], binned=False)

    def _plan(self, batch_size: int) -> Plan:
        b = self.costs.bucket(batch_size)
        self.seen[b] = self.seen.get(b, 0) + 1
        plan = self._explore_plan(b)
        if plan is not None:
            return plan
        if self.timed_since_fit.get(b, 0) >= REFIT_EVERY or b not in self.planned:
            self.timed_since_fit[b] = 0
            self.planned.add(b)
            self.policy.refit()
            self._save_costs()
        return self.policy.round_plan(batch_size)     # (with its probe steps of the other kind)

    def _save_costs(self) -> None:
        if not self.learn:
            return
        try:
            self.costs.save(self.costs_path)
        except OSError:
            pass                       # a read-only cache costs the next process an exploration

    # -- timing and acceptance of the step that just ran -------------------------------------
    def _observe_step(self, batch_size: int, num_tokens: int, max_query_len: int,
                      num_rejected: Optional[torch.Tensor], now: float) -> None:
        if self._trace is not None:
            self._trace_step(batch_size, num_tokens, max_query_len, num_rejected, now)
        if not self.learn:                 # frozen: plans depend on the batch and the entropies only
            return
        step_s = None                      # the whole previous step (draft + target), if clean
        if self._step_end is not None and max_query_len <= 1 + self.max_draft:   # no prefill in it
            ms = 1e3 * (now - self._step_end)
            pred = self.costs.predict_target(batch_size, num_tokens)
            if pred is None or ms < 3.0 * pred:        # else: the engine was idle
                self.costs.add_target(batch_size, num_tokens, ms)
                b = self.costs.bucket(batch_size)
                self.timed_since_fit[b] = self.timed_since_fit.get(b, 0) + 1
                step_s = 1e-3 * (ms + self._prev_draft_ms)
        plan = self._prev_plan
        if plan is not None and not plan.speculate:     # a plain step: timed for the policy's guard
            if step_s is not None:
                self.policy.observe(plan, [], [], seconds=step_s)
            return
        if num_rejected is not None and plan is not None and plan.predicted_accept is not None and self._prev:
            rejected = num_rejected.tolist()
            bins, accepted, drafted = [], [], []
            for i, rid in enumerate(self.hs_runner.input_batch.req_ids[:len(rejected)]):
                if rid in self._prev:          # every request: its bin; positions up to its chain
                    b, k = self._prev[rid]
                    bins.append(b)
                    accepted.append(max(0, k - int(rejected[i])) if k > 0 else 0)
                    drafted.append(k)            # the plan's chain, cut to vLLM's K
            if bins:
                self.policy.observe(plan, bins, accepted, seconds=step_s, drafted=drafted)

    def _trace_step(self, batch_size, num_tokens, max_query_len, num_rejected, now) -> None:
        """One JSON line for the step that just ran: its plan, draft lengths, draft and target
        milliseconds, tokens in the target forward, and the drafts the target rejected."""
        import json
        rec = {"batch": batch_size, "tokens": num_tokens, "max_query_len": max_query_len,
               "plan": self._prev_plan.name if self._prev_plan is not None else None,
               "k": [k for _, k in self._prev.values()], "draft_ms": round(self._prev_draft_ms, 3),
               "target_ms": None if self._step_end is None else round(1e3 * (now - self._step_end), 3),
               "rejected": None if num_rejected is None or not self._prev else num_rejected.tolist()}
        self._trace.write(json.dumps(rec) + "\n")
        self._trace.flush()

    # -- vLLM's hooks ------------------------------------------------------------------------
    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None):
        now = time.perf_counter()
        batch_size = common_attn_metadata.batch_size()
        max_query_len = int(common_attn_metadata.max_query_len)
        self._observe_step(batch_size, int(common_attn_metadata.num_actual_tokens), max_query_len,
                           num_rejected_tokens_gpu, now)
        req_ids = list(self.hs_runner.input_batch.req_ids[:batch_size])
        limit = min(int(num_speculative_tokens), self.max_draft)
        plan = self._plan(batch_size)
        prefill = max_query_len > 1 + self.max_draft
        mode = SPECULATE if plan.speculate and limit > 0 else \
            WARM if limit > 0 and (prefill or self._keep_warm(batch_size, plan)) else PLAIN
        if self.tp_group is not None:            # every rank runs rank 0's forwards
            flag = torch.tensor([mode], device=self.device)
            mode = int(self.tp_group.broadcast(flag, src=0)[0].item())
        if mode == SPECULATE and not plan.speculate:     # another TP rank's plan: this rank follows rank 0
            plan = self._chain_plan("follow", 1)
        if mode != SPECULATE:
            if mode == WARM:   # the draft's KV cache gets this step's tokens; the step stays plain
                super().propose(0, target_token_ids, target_positions, target_hidden_states, next_token_ids,
                                token_indices_to_sample, common_attn_metadata, sampling_metadata,
                                mm_embed_inputs=mm_embed_inputs, num_rejected_tokens_gpu=num_rejected_tokens_gpu,
                                slot_mappings=slot_mappings)
                self.num_speculative_tokens = self.max_draft
            # (a warm forward is not charged to the plain step: the guard compares speculation
            # with what plain decoding costs)
            self._prev, self._prev_plan, self._prev_draft_ms = {}, plan, 0.0
            self._step_end = time.perf_counter()
            return [[] for _ in range(batch_size)]
        self._decision = (plan, limit, None)
        t0 = time.perf_counter()
        drafts = super().propose(max(limit, 1), target_token_ids, target_positions, target_hidden_states,
                                 next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                                 mm_embed_inputs=mm_embed_inputs, num_rejected_tokens_gpu=num_rejected_tokens_gpu,
                                 slot_mappings=slot_mappings)
        draft_ms = 1e3 * (time.perf_counter() - t0)
        _, _, decided = self._decision
        self._decision = None
        self.num_speculative_tokens = self.max_draft
        bins, ks = decided if decided is not None else ([0] * batch_size, [min(limit, 1)] * batch_size)
        if self.learn and not prefill:      # (a prefill's first forward runs over the prompt)
            self.costs.add_draft(batch_size, max(0, drafts.shape[1] - 1), draft_ms)
        rows = drafts.tolist()
        out: List[List[int]] = [row[:k] for row, k in zip(rows, ks)]
        self._prev = {rid: (b, k) for rid, b, k in zip(req_ids, bins, ks)}
        self._prev_plan, self._prev_draft_ms = plan, draft_ms
        self._step_end = time.perf_counter()
        return out

    def _keep_warm(self, batch_size: int, plan: Plan) -> bool:
        """Whether a plain step runs the draft's first forward anyway (``WARM``).

        vLLM's draft keeps its own KV cache, written only by the draft's forwards: a step that
        skips the drafter leaves a hole at that step's positions in every request, and the
        draft attends over the holes for the rest of the request (its acceptance fell the
        longer plain stretches lasted). Plain steps inside speculation (the policy's probes,
        the guard's fallback, exploration) therefore run the first forward, a small share of a
        step at the batch sizes where speculation pays; a bucket whose fitted plan is plain
        decodes as vLLM's autoregressive steps do, drafter off. Steps with a prefill always
        run it (``propose``): a prompt the draft never saw is a hole of its own."""
        if plan.name.startswith("explore"):
            return True
        b = self.costs.bucket(batch_size)
        if b not in self.planned:
            return True
        return self.policy.fitted_plan(batch_size).speculate

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        tokens, probs = super()._sample_draft_tokens(hidden_states, sampling_metadata)
        if self._decision is not None and self._decision[2] is None:
            self._decide(hidden_states)
        return tokens, probs

    def _decide(self, hidden_states: torch.Tensor) -> None:
        """After the first draft forward: each request's bin and draft length; the loop of
        ``EagleProposer.propose`` (version-pinned) then runs ``num_speculative_tokens - 1`` more
        forwards, so that is set to the longest chain of the batch."""
        plan, limit, _ = self._decision
        B = hidden_states.shape[0]
        if plan.binned and plan.num_bins > 1:
            logits = self.model.compute_logits(hidden_states).float()
            _, _, entropy = ops.topk_entropy(logits, plan.entropy_k)
            bins_t, _, budget_t = plan.decide(entropy.contiguous())
        else:
            bins_t = torch.zeros(B, dtype=torch.int64, device=hidden_states.device)
            budget_t = torch.full((B,), plan.budget[0], dtype=torch.int64, device=hidden_states.device)
        budget_t = budget_t.clamp(max=limit)
        if self.tp_group is not None:                      # every TP rank runs rank 0's loop
            budget_t = self.tp_group.broadcast(budget_t.contiguous(), src=0)
        bins, ks = bins_t.tolist(), budget_t.tolist()
        self._decision = (plan, limit, (bins, ks))
        self.num_speculative_tokens = max(1, max(ks) if ks else 1)
