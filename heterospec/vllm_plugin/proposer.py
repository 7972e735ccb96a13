"""HeteroSpec as vLLM's EAGLE-3 proposer: per request and per step, how many tokens to draft.

vLLM's :class:`EagleProposer` drafts a chain of ``num_speculative_tokens`` tokens for every
request: one forward over the step's new tokens (it also fills the draft's KV cache), then one
single-token forward per further draft token. :class:`HeteroSpecProposer` keeps that code and
decides, once per step, between the first forward and the loop:

1. **Plain steps.** When the fitted plan for this batch size says speculation does not pay
   (``Plan.speculate`` false), the drafter does not run (except over a prefill) and every
   request gets no draft: the step costs what vLLM's autoregressive step costs. Plain steps
   inside speculation (probes, exploration, the guard until speculation lost twice) run the
   draft's first forward only (``WARM``, see
   :meth:`HeteroSpecProposer._keep_warm`). Such a step is what speculation is weighed against
   (:class:`StepCosts` ``plain_ms``, and the guard's timing of plain steps): a speculative step
   pays when it beats a warm plain step, and the drafter goes off only when it does not.
2. **Entropy bins.** Otherwise, after the first forward, each request's Top-K entropy of the
   draft distribution (``torch.ops.heterospec.topk_entropy``, the first node of HeteroSpec's
   meta-path) selects its bin, and the bin's action its draft length ``k`` (0 .. the configured
   ``num_speculative_tokens``). The loop runs until the longest request is done; each request's
   chain is cut to its ``k``. vLLM's scheduler schedules exactly those tokens and vLLM's rejection
   sampler verifies them, so the output is vLLM's.
3. **Path stop** (``path_stop``, on by default; fitted plans, greedy drafts). Where the
   bin drafts, the chain's length is decided step by step instead of at the first forward: after
   every draft forward each request's cumulative path survival (:mod:`.pathstop`) says whether
   its token is worth verifying and whether another forward pays at this step's measured
   tokens per ms. vLLM's loop runs a fixed number of forwards; an early stop leaves it by an
   exception that :meth:`HeteroSpecProposer.propose` catches with the tokens drafted so far.
4. **Context lookup** (``lookup``, on by default). Before the plan's step, each request's
   chain copied from its own context (:mod:`.lookup`) is weighed by a :class:`LookupGate`; where
   the copied chains are expected to beat the plan, the step verifies them instead, running only
   the draft's warm first forward (where the drafter would have run) and no draft loop.

The per-bin actions come from :class:`heterospec.policy.FittedPolicy` (the policy of our own
engine) with the draft's chain acceptance tables (``acceptance_tables_chain.json``) and a cost
model learned from vLLM's own steps (:class:`StepCosts`). A batch-size bucket is explored first,
cheapest steps first (:meth:`HeteroSpecProposer._explore_plan`), and briefly again every
``REEXPLORE`` steps.

With tensor parallelism every rank runs this proposer; rank 0 decides each step's kind, the draft
lengths and the path stop's forwards, and the other ranks run the same forwards
(:meth:`HeteroSpecProposer._follow_rank0`; vLLM's scheduler takes rank 0's drafts only).

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
from ..sampling import greedy_tokens
from .costs import StepCosts
from .lookup import LookupSteps
from .options import HeteroSpecSetupError, default_costs_path, load_chain_tables
from .pathstop import ConfidenceCalibration, LookaheadCalibration, PathStop

logger = init_logger("vllm.heterospec")

REEXPLORE = 256          # steps of a bucket between two short exploration bursts
EXPLORE_PLAIN = 3        # plain steps timed before a bucket drafts at all
EXPLORE_SPEC = 2         # 1-token steps timed before the bound check (their median is the level)
EXPLORE_DRAFTING = 12    # drafting exploration steps of a bucket at most (outside the REEXPLORE refreshes)
REFIT_EVERY = 32         # timed steps of a bucket between two policy refits
PLAIN, WARM, SPECULATE = 0, 1, 2   # what a step does with the drafter: skip it, first forward only, draft
LOOKUP, LOOKUP_WARM = 3, 4         # a context-lookup step: copied chains (after the warm forward)
TRACE_ENV = "HETEROSPEC_VLLM_TRACE"   # a file: one JSON line per step (batch, tokens, times, plan)
RATE_KEEP = 0.8          # exponential memory of the tokens per ms of speculative steps (path stop)


class _ChainStop(Exception):
    """Raised out of vLLM's draft loop when the path stop ends the chain early."""


class HeteroSpecProposer(EagleProposer):
    """vLLM's EAGLE-3 proposer with HeteroSpec's per-request draft lengths (see the module).

    Instances are vLLM ``EagleProposer`` objects whose class was switched by
    :func:`heterospec.vllm_plugin.patch.install`; :meth:`setup` adds our state."""

    def setup(self, runner, options: dict) -> None:
        from vllm.distributed import get_tp_group
        self.hs_runner = runner
        # With TP the draft's forwards hold collectives, so every rank must run the same loop:
        # the per-request lengths (entropy bins are identical on every rank, the timed plans need
        # not be) come from TP rank 0 (_follow_rank0, _decide). None at TP 1.
        group = get_tp_group()
        self.tp_group = group if group.world_size > 1 else None
        self.tp_follower = self.tp_group is not None and group.rank_in_group != 0
        spec = self.vllm_config.speculative_config
        self.max_draft = int(spec.num_speculative_tokens)
        self.tables = load_chain_tables(spec.model, options)
        self.learn = options.get("learn", True)
        self.draft_stream = options.get("draft_stream", True)
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
        self.explored: Dict[int, int] = {}            # bucket -> drafting exploration steps run
        self.timed_since_fit: Dict[int, int] = {}
        self._step_end: Optional[float] = None        # end of the previous propose call
        self._prev: Dict[str, Tuple[int, int]] = {}   # req id -> (bin, draft tokens) proposed last step
        self._prev_plan: Optional[Plan] = None       # the plan of the previous step (plain too)
        self._after_switch = False                    # the previous step: plain, right after a speculative one
        self._prev_draft_ms = 0.0                     # its draft time
        self._prev_forwards = 0                       # its draft forwards (trace)
        self._prev_warm_ms = 0.0                      # its warm forward's time (plain steps)
        self._prev_warm_charged = 0.0                 # ... charged to the step (0 over a prefill)
        self._prev_ours_ms = 0.0                      # its time in propose outside draft forwards
        self._decision = None
        # path stop: per device-independent confidence bucket, what the target accepted; per
        # batch bucket, the tokens per ms of speculative steps; this call's chain
        self.path_stop = bool(options.get("path_stop", True))
        self.calibration = ConfidenceCalibration()
        self.lookahead = LookaheadCalibration(self.calibration)
        self.rate: Dict[int, float] = {}
        self._path: Optional[PathStop] = None
        self._path_follow = False                     # TP: rank 0 runs a path stop this call
        self._chain: List[torch.Tensor] = []
        self._prev_conf: Dict[str, List[float]] = {}  # req id -> confidences of its kept drafts
        # context lookup (.lookup): chains copied from each request's tokens, when they pay (with
        # TP, rank 0's choice: a lookup step skips the draft loop on every rank)
        # ... and from the lookup corpus shipped next to the draft (heterospec.datastore), unless
        # 'corpus': false; the gate starts from the lookup prior shipped there
        corpus = prior = None
        if options.get("lookup", True):
            from ..datastore import corpus_for
            from ..lookup import load_lookup_prior
            vocab = getattr(self.vllm_config.model_config.hf_config, "vocab_size", None)
            corpus = corpus_for(spec.model, vocab) if options.get("corpus", True) else None
            prior = load_lookup_prior(spec.model, vocab)
        self.lookup = (LookupSteps(self.max_draft, history=options.get("history", True), corpus=corpus, prior=prior)
                       if options.get("lookup", True) else None)
        self._sampled = None                          # this step's sampled rows and discard mask
        self._lookup_plan = self._chain_plan("lookup", 1)   # what a lookup step leaves as the previous plan
        if self.lookup is not None:
            self.lookup.gate.load(self._lookup_path())
        self._trace = open(os.environ[TRACE_ENV], "a") if os.environ.get(TRACE_ENV) else None
        logger.info("HeteroSpec: per-request draft lengths 0..%d from %d-bin chain tables (%s)%s%s; step costs %s (%s)",
                    self.max_draft, len(self.tables.options[0].edges) + 1, self.tables.provenance.get("date", "?"),
                    ", path stop" if self.path_stop else "",
                    (", context lookup" + (" and corpus" if self.lookup.corpus is not None else ""))
                    if self.lookup is not None else "",
                    self.costs_path, "learning" if self.learn else "frozen")

    # -- the plan of this step ---------------------------------------------------------------
    def _explore_plan(self, b: int) -> Optional[Plan]:
        """The plan of an exploration step at bucket ``b``, or None once its costs are known.

        Cheapest first: plain steps (the plain level, free), steps drafting 1 token per request
        (the speculative step's level and the draft's first forward), and only if the plan is
        still worth drafting with the speculative line flat and the draft's loop free (an
        optimistic bound) steps drafting 2 (the slopes of both lines). A bucket where
        speculation cannot pay is therefore settled after one drafting step. Each kind of step
        runs while what it measures is missing: a bucket whose speculative line got its points
        from other steps (copied chains, the tail of a batch) still needs the draft's first
        forward alone, and 2-token steps never measure it (they ran for the rest of a run at
        batch 3 before, bench/RESULTS.md, thirty-eighth session). At most ``EXPLORE_DRAFTING``
        drafting steps per bucket: then the plan uses what was measured (a line without a slope
        is flat). Every ``REEXPLORE`` steps one 1-token step refreshes the low end of the line."""
        if not self.learn:
            return None
        n_plain, n_spec, _, t_ready, d_ready = self.costs.state(b)
        if n_plain < EXPLORE_PLAIN:
            return Plan("explore-plain", speculate=False, binned=False)
        if self._refresh(b):
            return self._chain_plan("explore", 1)
        if self.explored.get(b, 0) >= EXPLORE_DRAFTING:
            return None
        if n_spec < EXPLORE_SPEC or not self.costs.draft_first_measured(b):
            return self._chain_plan("explore", 1)
        if not (t_ready and d_ready) and self.max_draft >= 2:     # (with K = 1 the slopes never matter)
            if b not in self.bound_checked:
                self.bound_checked.add(b)
                self.policy.refit()
            if self.policy.plan(b).speculate:      # worth drafting even if longer chains were free
                return self._chain_plan("explore", 2)
        return None

    def _refresh(self, b: int) -> bool:
        """Whether this step of bucket ``b`` is an every-``REEXPLORE`` refresh of the line's low end."""
        seen = self.seen.get(b, 0)
        return seen >= REEXPLORE and seen % REEXPLORE == 0

    @staticmethod
    def _chain_plan(name: str, k: int) -> Plan:
        """Every request drafts ``k`` tokens (no bins)."""
        return Plan(name, decide_depth=0, entropy_k=4, edges=[], depth=[k - 1], budget=[k], binned=False)

    def _plan(self, batch_size: int) -> Plan:
        b = self.costs.bucket(batch_size)
        self.seen[b] = self.seen.get(b, 0) + 1
        plan = self._explore_plan(b)
        if plan is not None:
            if plan.speculate and not self._refresh(b):    # (counted here: _explore_plan is also asked
                self.explored[b] = self.explored.get(b, 0) + 1   # by the lookup choice, which runs none)
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
        if self.lookup is not None:
            self.lookup.gate.save(self._lookup_path())

    def _lookup_path(self) -> str:
        """The lookup gate's learned state, beside the step costs (``<costs>.lookup.json``)."""
        return self.costs_path.removesuffix(".json") + ".lookup.json"

    # -- timing and acceptance of the step that just ran -------------------------------------
    def _observe_step(self, batch_size: int, num_tokens: int, max_query_len: int,
                      num_rejected: Optional[torch.Tensor], now: float) -> None:
        # the previous step's requests, once: (req id, bin, drafts, accepted drafts)
        lookup_step = self.lookup is not None and self.lookup.pending
        rejected = num_rejected.tolist() if num_rejected is not None and (self._prev or lookup_step) else None
        step_ids = self.hs_runner.input_batch.req_ids[:batch_size]
        outcome = [] if rejected is None else \
            [(rid, *self._prev[rid], max(0, self._prev[rid][1] - int(rej)))
             for rid, rej in zip(step_ids, rejected) if rid in self._prev]
        if self._trace is not None:
            self._trace_step(batch_size, num_tokens, max_query_len, rejected, now)
        if outcome and self._prev_conf:    # the path stop's confidence calibration (in frozen mode
            # too: it depends on the texts only, not on timing)
            confs, acc = [self._prev_conf[o[0]] for o in outcome], [o[3] for o in outcome]
            self.calibration.observe(confs, acc)
            self.lookahead.observe(confs, acc)
        if not self.learn:                 # frozen: plans depend on the batch, the entropies and the texts
            if lookup_step:
                self.lookup.observe(step_ids, rejected, None)
            return
        step_s = None                      # the whole previous step (draft + target), if clean
        # No prefill in it, and not the first plain step after a speculative one: that step runs
        # slower than plain steps after plain steps (+9-27 % in every traced engine that decoded
        # mostly plainly: bench/RESULTS.md, twenty-fourth session), a cost of the switch rather
        # than of plain decoding. So a plain probe inside speculation is two plain steps (see
        # propose), and only the second is timed (cost lines, guard, corrections).
        if self._step_end is not None and max_query_len <= 1 + self.max_draft and not self._after_switch:
            ms = 1e3 * (now - self._step_end)
            pred = self.costs.predict_target(batch_size, num_tokens)
            if pred is None or ms < 3.0 * pred:        # else: the engine was idle
                self.costs.add_target(batch_size, num_tokens, ms)
                b = self.costs.bucket(batch_size)
                self.timed_since_fit[b] = self.timed_since_fit.get(b, 0) + 1
                # (a plain step is charged its warm forward: what it cost, and what a plain
                # step costs wherever the plan may speculate, see StepCosts). In normalized
                # milliseconds, as every cost the policy compares it with (StepCosts.normalize).
                step_s = 1e-3 * self.costs.normalize(ms + self._prev_draft_ms + self._prev_warm_charged)
        if lookup_step:                    # the gate's step, not the plan's: its acceptance and time
            self.lookup.observe(step_ids, rejected, step_s)
            return
        plan = self._prev_plan
        if plan is not None and not plan.speculate:     # a plain step: timed for the policy's guard
            if step_s is not None:
                self.policy.observe(plan, [], [], seconds=step_s)
            return
        if outcome and plan is not None:   # every request: its bin; positions up to its chain
            bins, drafted, accepted = [o[1] for o in outcome], [o[2] for o in outcome], [o[3] for o in outcome]
            if step_s is not None:             # what a speculative step makes per ms (path stop)
                bucket = self.costs.bucket(batch_size)
                rate = (len(bins) + sum(accepted)) / (1e3 * step_s)
                old = self.rate.get(bucket)
                self.rate[bucket] = rate if old is None else RATE_KEEP * old + (1.0 - RATE_KEEP) * rate
            if plan.predicted_accept is not None:
                self.policy.observe(plan, bins, accepted, seconds=step_s, drafted=drafted)

    def _trace_step(self, batch_size, num_tokens, max_query_len, rejected, now) -> None:
        """One JSON line for the step that just ran: its plan, draft lengths, draft and target
        milliseconds, tokens in the target forward, and the drafts the target rejected."""
        import json
        rec = {"pid": os.getpid(), "batch": batch_size, "tokens": num_tokens, "max_query_len": max_query_len,
               "plan": self._prev_plan.name if self._prev_plan is not None else None,
               "k": [k for _, k in self._prev.values()], "draft_ms": round(self._prev_draft_ms, 3),
               "target_ms": None if self._step_end is None else round(1e3 * (now - self._step_end), 3),
               "warm_ms": round(self._prev_warm_ms, 3), "ours_ms": round(self._prev_ours_ms, 3),
               "rejected": rejected, "lookup": self.lookup.pending_lengths() if self.lookup is not None else None,
               "path_stop": bool(self._prev_conf), "speed": round(self.costs.speed, 4),
               "draft_streamed": getattr(self, "draft_streamed", 0), "forwards": self._prev_forwards}
        b = self.costs.bucket(batch_size)
        if b in self.planned:       # the policy's view: the model's verdict, the guard's, its corrections
            realized = self.policy.realized(b)
            rec.update({"model_speculates": self.policy.fitted_plan(batch_size).speculate,
                        "guard_plain": self.policy.realized_loses(b),
                        "realized": None if realized is None else [round(x, 3) for x in realized],
                        "position_scale": list(self.policy.position_scale()),
                        "time_scale": self.policy.time_scale(b), "plain_scale": self.policy.plain_scale(b)})
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
        prefill = max_query_len > 1 + self.max_draft
        forward = dict(target_token_ids=target_token_ids, target_positions=target_positions,
                       target_hidden_states=target_hidden_states, next_token_ids=next_token_ids,
                       token_indices_to_sample=token_indices_to_sample, common_attn_metadata=common_attn_metadata,
                       sampling_metadata=sampling_metadata, mm_embed_inputs=mm_embed_inputs,
                       num_rejected_tokens_gpu=num_rejected_tokens_gpu, slot_mappings=slot_mappings)
        chosen, plan = None, None
        if self.lookup is not None:        # context lookup first: copied chains, where they pay
            self._feed_lookup(req_ids)
            chosen = None if prefill or limit < 1 else self._lookup_choice(batch_size, req_ids, limit)
        if chosen is not None:
            mode = LOOKUP_WARM if chosen[1] else LOOKUP
        else:
            plan = self._plan(batch_size)
            if plan.speculate and self._after_switch and self._prev_plan is not None and not self._prev_plan.speculate:
                plan = self._prev_plan            # a plain probe's second step (the one that is timed)
            mode = SPECULATE if plan.speculate and limit > 0 else \
                WARM if limit > 0 and (prefill or self._keep_warm(batch_size, plan)) else PLAIN
        if self.tp_group is not None:            # every rank runs rank 0's forwards
            mode, chosen, plan = self._follow_rank0(mode, chosen, plan)
        if chosen is not None:
            return self._lookup_step(req_ids, *chosen, forward, now)
        if self.lookup is not None:
            self.lookup.forget_step()
        # this step: the first plain one after a speculative step (untimed; the next is plain too)
        self._after_switch = mode != SPECULATE and self._prev_plan is not None and self._prev_plan.speculate
        if mode != SPECULATE:
            t0 = time.perf_counter()
            if mode == WARM:   # the draft's KV cache gets this step's tokens; the step stays plain
                self._first_forward_only(forward)
            self._prev, self._prev_plan, self._prev_draft_ms, self._prev_conf = {}, plan, 0.0, {}
            self._prev_forwards = int(mode == WARM)
            self._step_end = time.perf_counter()
            self._prev_warm_ms = 1e3 * (self._step_end - t0)
            # the warm forward over a prompt is a one-off of the request, not of plain steps
            self._prev_warm_charged = self._prev_warm_ms if mode == WARM and not prefill else 0.0
            if self._prev_warm_charged and self.learn and not self._after_switch:
                # (after a speculative step the warm forward runs over its accepted tokens too)
                self.costs.add_warm(batch_size, self._prev_warm_charged)
            self._prev_ours_ms = 1e3 * (t0 - now)
            return [[] for _ in range(batch_size)]
        self._decision = (plan, limit, None)
        self._path, self._chain, self._path_follow = None, [], False
        t0 = time.perf_counter()
        try:
            drafts = super().propose(max(limit, 1), target_token_ids, target_positions, target_hidden_states,
                                     next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                                     mm_embed_inputs=mm_embed_inputs, num_rejected_tokens_gpu=num_rejected_tokens_gpu,
                                     slot_mappings=slot_mappings)
        except _ChainStop:                  # the path stop left vLLM's loop early
            drafts = torch.stack(self._chain, dim=1)
        draft_ms = 1e3 * (time.perf_counter() - t0)
        _, _, decided = self._decision
        self._decision = None
        self.num_speculative_tokens = self.max_draft
        bins, ks = decided if decided is not None else ([0] * batch_size, [min(limit, 1)] * batch_size)
        path, self._path, self._chain = self._path, None, []
        if path is not None:
            ks = path.lengths
        if self.learn and not prefill:      # (a prefill's first forward runs over the prompt)
            self.costs.add_draft(batch_size, max(0, drafts.shape[1] - 1), draft_ms)
        rows = drafts.tolist()
        out: List[List[int]] = [row[:k] for row, k in zip(rows, ks)]
        self._prev = {rid: (b, k) for rid, b, k in zip(req_ids, bins, ks)}
        self._prev_conf = {} if path is None else dict(zip(req_ids, path.confidences))
        self._prev_plan, self._prev_draft_ms, self._prev_forwards = plan, draft_ms, drafts.shape[1]
        self._step_end = time.perf_counter()
        self._prev_warm_ms, self._prev_warm_charged = 0.0, 0.0
        self._prev_ours_ms = 1e3 * (self._step_end - now) - draft_ms
        return out

    def _follow_rank0(self, mode: int, chosen, plan: Optional[Plan]):
        """With tensor parallelism: ``(mode, chosen, plan)`` of this step on this rank, rank 0's kind
        of step. The draft's forwards hold collectives, so every rank runs the forwards rank 0 runs;
        plans use measured times, which differ per rank. vLLM's scheduler takes rank 0's drafts
        only, so another rank's lookup step proposes nothing and learns nothing (``chosen`` with
        no round), and its speculative step drafts rank 0's number of tokens (:meth:`_decide`)."""
        flag = torch.tensor([mode], device=self.device)
        mode = int(self.tp_group.broadcast(flag, src=0)[0].item())
        if not self.tp_follower:
            return mode, chosen, plan
        if mode in (LOOKUP, LOOKUP_WARM):
            return mode, (None, mode == LOOKUP_WARM), plan
        if mode == SPECULATE and (plan is None or not plan.speculate):
            plan = self._chain_plan("follow", 1)
        elif plan is None:
            plan = Plan("follow-plain", speculate=False, binned=False)
        return mode, None, plan

    def load_model(self, target_model) -> None:
        """vLLM's, with the draft's float16-valued linears streamed on decode-sized inputs
        (:func:`.patch.streamed_draft_linears`, option ``draft_stream``)."""
        from .patch import streamed_draft_linears
        with streamed_draft_linears(self.draft_stream):
            super().load_model(target_model)
        self.draft_streamed = sum(1 for m in self.model.modules()
                                  if getattr(getattr(m, "cpu_linear", None), "_heterospec_stream", False))
        logger.info("HeteroSpec: %d draft linears stream their float16 copies on decode steps", self.draft_streamed)

    def _first_forward_only(self, forward: dict) -> None:
        """The draft's first forward over the step's tokens, no drafts (``WARM``): the draft's KV
        cache gets this step's entries."""
        EagleProposer.propose(self, 0, **forward)
        self.num_speculative_tokens = self.max_draft

    # -- context lookup (.lookup) ------------------------------------------------------------
    def prepare_next_token_ids_padded(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask):
        """vLLM's, unchanged; the step's sampled rows (rejected positions -1) and discard mask are
        kept for the context indices (this runs right before :meth:`propose`, which runs before the
        runner's bookkeeping of the step)."""
        out = super().prepare_next_token_ids_padded(sampled_token_ids, requests, gpu_input_batch, discard_request_mask)
        if getattr(self, "lookup", None) is not None:
            n = gpu_input_batch.num_reqs
            self._sampled = (sampled_token_ids[:n], discard_request_mask[:n])
        return out

    def _feed_lookup(self, req_ids: List[str]) -> None:
        got, self._sampled = self._sampled, None
        requests = self.hs_runner.requests

        def committed(rid):
            req = requests.get(rid)
            if req is None or req.prompt_token_ids is None:
                return None
            return req.prompt_token_ids, req.output_token_ids
        if got is None:         # (vLLM's unpadded drafter batch: the step's tokens are not at hand)
            self.lookup.feed(req_ids, None, None, committed, 0)
            return
        sampled, discard = got
        self.lookup.feed(req_ids, sampled.tolist(), discard.tolist(), committed,
                         int(self.hs_runner.input_batch.vocab_size))

    def _room(self, rid: str) -> int:
        """Tokens request ``rid`` may still emit after this step (max_tokens, max_model_len)."""
        n, req = self.lookup.length(rid), self.hs_runner.requests.get(rid)
        if n is None or req is None:
            return 0
        end = int(self.vllm_config.model_config.max_model_len)
        sp = getattr(req, "sampling_params", None)
        if sp is not None and sp.max_tokens is not None:
            end = min(end, len(req.prompt_token_ids) + int(sp.max_tokens))
        return max(0, end - n)

    def _lookup_choice(self, batch_size: int, req_ids: List[str], limit: int):
        """``(chosen LookupRound, run the warm forward)`` for this step, or None (the plan's step).

        Only in a bucket whose costs are explored (exploration steps time the plan's kinds of
        step). The alternative is the fitted plan's (guard included): a speculative plan's
        predicted tokens per second, or a plain step, warm where the plan keeps the draft warm.
        The lookup step runs the warm forward where the drafter would have run."""
        b = self.costs.bucket(batch_size)
        if b not in self.planned or self._explore_plan(b) is not None:
            return None
        fitted = self.policy.plan(batch_size)
        keep_warm = self._keep_warm(batch_size, fitted)
        warm = self.costs.warm_ms(batch_size) if keep_warm else 0.0

        def alternative() -> float:
            if fitted.speculate:
                return ((fitted.expected or {}).get("speculative") or {}).get("tokens_per_s", 0.0)
            return 1e3 * batch_size / (self.costs.plain_level(batch_size) + warm)
        room = [self._room(rid) for rid in req_ids]
        chosen = self.lookup.choose(req_ids, limit, room, self.costs, batch_size, warm, alternative)
        return None if chosen is None else (chosen, keep_warm)

    def _lookup_step(self, req_ids: List[str], chosen, warm: bool, forward: dict, now: float) -> List[List[int]]:
        """Propose the copied chains (after the draft's warm forward where the drafter would have
        run). ``chosen`` None: another TP rank's part of rank 0's lookup step (its forwards only)."""
        t0 = time.perf_counter()
        if warm:
            self._first_forward_only(forward)
        warm_ms = 1e3 * (time.perf_counter() - t0)
        if chosen is None:
            self.lookup.forget_step()
        else:
            self.lookup.ran(req_ids, chosen)
        self._prev, self._prev_conf, self._prev_plan = {}, {}, self._lookup_plan
        self._after_switch = False
        # (the warm forward is part of the step's time, as a drafted step's draft time is)
        self._prev_draft_ms, self._prev_warm_ms, self._prev_warm_charged = warm_ms, warm_ms, 0.0
        self._prev_forwards = int(warm)
        self._step_end = time.perf_counter()
        self._prev_ours_ms = 1e3 * (self._step_end - now) - warm_ms
        return [[] for _ in req_ids] if chosen is None else [list(c) for c in chosen.chains]

    def _keep_warm(self, batch_size: int, plan: Plan) -> bool:
        """Whether a plain step runs the draft's first forward anyway (``WARM``).

        vLLM's draft keeps its own KV cache, written only by the draft's forwards: a step that
        skips the drafter leaves a hole at that step's positions in every request, and the
        draft attends over the holes for the rest of the request (its acceptance fell the
        longer plain stretches lasted). Plain steps inside speculation (the policy's probes,
        exploration, the guard's fallback until speculation has lost twice) therefore run the
        first forward. Its cost is part of the plain step the plan weighs speculation against
        (:class:`StepCosts`), so a bucket's fitted plan is plain only where speculation loses
        even to a warm plain step; such a bucket decodes as vLLM's autoregressive steps do,
        drafter off. So does a bucket the guard holds plain once its last speculative rounds
        lost as well (``FittedPolicy.held_plain``): a warm forward there costs every step ~5 %
        (batch 8 on the Zen 4, bench/RESULTS.md, thirty-eighth session) to keep a draft that
        was measured not to pay. Steps with a prefill always run it (``propose``): a prompt the
        draft never saw is a hole of its own."""
        if plan.name.startswith("explore"):
            return True
        b = self.costs.bucket(batch_size)
        if b not in self.planned:
            return True
        return self.policy.fitted_plan(batch_size).speculate and not self.policy.held_plain(b)

    def _greedy_logits(self, sampling_metadata) -> bool:
        """Whether vLLM's draft sampling is the argmax of ``compute_logits`` (then we compute
        the logits once and read the confidences from them too)."""
        return not getattr(self, "use_local_argmax_reduction", False) and \
            not getattr(self, "use_heterogeneous_vocab", False) and \
            (not getattr(self, "_enable_probabilistic_draft_probs", False) or sampling_metadata.all_greedy)

    def _draft_vocab_map(self) -> Optional[torch.Tensor]:
        """The target ids of the draft's own vocabulary, where it has one (EAGLE-3's ``d2t``) and
        they rise with the draft's ids; else None. (With TP, vLLM's logits processor all-gathers
        the draft's logits to every rank, as ``compute_logits`` does.)"""
        cached = getattr(self, "_vocab_map", False)
        if cached is not False:
            return cached
        out, d2t = None, getattr(self.model, "draft_id_to_target_id", None)
        if d2t is not None:
            targets = torch.arange(d2t.shape[0], device=d2t.device) + d2t.detach().long()
            if targets.numel() < 2 or bool((targets[1:] > targets[:-1]).all()):
                out = targets
        self._vocab_map = out
        return out

    def _draft_logits(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(logits, map)``: the draft's logits over its own vocabulary and the map of its ids to
        the target's, or ``compute_logits``' row over the target's vocabulary and None.

        vLLM's ``Eagle3LlamaForCausalLM.compute_logits`` spreads the draft's 8,192 logits over
        the target's 49,152 ids (-inf elsewhere) for every draft forward, and greedy sampling
        takes the argmax of that row: ~1 ms of each ~3 ms draft forward at batch 1 on the Zen 4
        (py-spy, bench/RESULTS.md, thirty-eighth session). With the map rising, the argmax over
        the draft's own logits, mapped, is the same token (ties too: the first of them in either
        order), and their softmax is the row's (its -inf entries weigh nothing)."""
        vocab_map = self._draft_vocab_map()
        if vocab_map is None:
            return self.model.compute_logits(hidden_states), None
        return self.model.logits_processor(self.model.lm_head, hidden_states), vocab_map

    def _greedy_tokens(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, logits)``: vLLM's greedy draft tokens, from :meth:`_draft_logits`."""
        logits, vocab_map = self._draft_logits(hidden_states)
        ids = greedy_tokens(logits)
        return (ids if vocab_map is None else vocab_map[ids]), logits

    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """vLLM's greedy draft sampling, from the draft's own logits (:meth:`_draft_logits`)."""
        if getattr(self, "use_local_argmax_reduction", False) or getattr(self, "use_heterogeneous_vocab", False):
            return super()._greedy_sample(hidden_states)
        return self._greedy_tokens(hidden_states)[0]

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        if self._decision is None:
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        logits = None
        if self._greedy_logits(sampling_metadata):
            tokens, logits = self._greedy_tokens(hidden_states)   # what vLLM's greedy draft sampling does
            probs = None
        else:
            tokens, probs = super()._sample_draft_tokens(hidden_states, sampling_metadata)
        self._chain.append(tokens)
        if self._decision[2] is None:
            self._decide(hidden_states, logits)
        elif self._path is not None or self._path_follow:
            go = True
            if self._path is not None:
                top1, _, _ = ops.topk_entropy(logits.float().contiguous(), 1)
                go = self._path.step(top1[:, 0].exp())
            if self.tp_group is not None:          # one flag per draft forward: rank 0's stop
                go = bool(self.tp_group.broadcast(torch.tensor([int(go)], device=hidden_states.device), src=0)[0].item())
            if not go and len(self._chain) < self.num_speculative_tokens:
                raise _ChainStop
        return tokens, probs

    def _start_path(self, plan: Plan, batch_size: int, limit: int) -> Optional[PathStop]:
        """A :class:`PathStop` for this call, or None where the bins' lengths stand: path stop
        off, a plan that is not the fitted one (exploration: fixed chains that time the costs),
        a chain of one token, or costs whose slopes are not measured yet."""
        if not self.path_stop or plan.predicted_accept is None or limit < 2:
            return None
        slopes = self.costs.slopes(batch_size)
        if slopes is None:
            return None
        _, draft_ms = slopes
        verify_ms = self.costs.marginal_verify_ms(batch_size, limit)    # per position (measured means)
        # tokens per ms: measured speculative steps (learning), else what plain steps make
        rate = self.rate.get(self.costs.bucket(batch_size)) if self.learn else None
        rate = rate or batch_size / self.costs.plain_ms(batch_size)
        return PathStop(self.calibration, rate, verify_ms, draft_ms, batch_size, limit, self.lookahead)

    def _decide(self, hidden_states: torch.Tensor, logits: Optional[torch.Tensor] = None) -> None:
        """After the first draft forward: each request's bin and draft length; the loop of
        ``EagleProposer.propose`` (version-pinned) then runs ``num_speculative_tokens - 1`` more
        forwards, so that is set to the longest chain of the batch (with the path stop: to the
        limit, and the path stop may end the loop sooner)."""
        plan, limit, _ = self._decision
        B = hidden_states.shape[0]
        top1 = None
        if plan.binned and plan.num_bins > 1:
            if logits is None:
                logits, _ = self._draft_logits(hidden_states)
            top, _, entropy = ops.topk_entropy(logits.float().contiguous(), plan.entropy_k)
            top1 = top[:, 0]
            bins_t, _, budget_t = plan.decide(entropy.contiguous())
        else:
            bins_t = torch.zeros(B, dtype=torch.int64, device=hidden_states.device)
            budget_t = torch.full((B,), plan.budget[0], dtype=torch.int64, device=hidden_states.device)
        budget_t = budget_t.clamp(max=limit)
        ks = budget_t.tolist()
        self.num_speculative_tokens = max(1, max(ks) if ks else 1)
        path = None if self.tp_follower or logits is None else self._start_path(plan, B, limit)
        if path is not None and any(ks):
            if top1 is None:
                top1 = ops.topk_entropy(logits.float().contiguous(), 1)[0][:, 0]
            path.begin(ks)
            self._path = path
            self.num_speculative_tokens = limit if path.step(top1.exp()) else 1
        if self.tp_group is not None:      # every TP rank runs rank 0's loop: its lengths, forwards, path stop
            loop = torch.tensor([self.num_speculative_tokens, int(self._path is not None)], device=budget_t.device)
            got = self.tp_group.broadcast(torch.cat([budget_t.long(), loop.long()]).contiguous(), src=0).tolist()
            ks, (self.num_speculative_tokens, follow) = got[:B], got[B:]
            self._path_follow = bool(follow) and self._path is None
        self._decision = (plan, limit, (bins_t.tolist(), ks))
