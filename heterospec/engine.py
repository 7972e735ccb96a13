"""The decoding loop: autoregressive, EAGLE-3 and HeteroSpec on one target and one draft.

Read top to bottom: :meth:`Engine.generate_batch` prefills, then repeats one *round* until every
request is done. A speculative round is

    _draft_tree    draft extend over last round's tokens, then EAGLE-2 expansion; HeteroSpec
                   measures H(P*) after the base depth, picks the entropy bin and, in easy bins,
                   keeps expanding (dynamic extended drafting)
    _verify        select the Top-N nodes (Top-N pruning in easy bins), build the tree, one target
                   forward over it, greedy or rejection-sampling acceptance, KV compaction
    _commit        emit accepted drafts + bonus, stop at EOS / max_new_tokens, queue the draft's
                   next extend

Every tensor carries the request dimension ``B``; each request has its own tree, depth and budget.
Shapes follow ``docs/design.md``.
"""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import gc
import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from . import ops
from ._checks import sync_free, usable_device
from ._io import save_throttled
from .config import SamplingParams, SpecConfig, _as_int, default_config
from .entropy import EntropyBins
from .graphs import RoundGraphs
from .datastore import CORPUS_FILE, CorpusIndex, corpus_for
from .lookup import (CORPUS_ROW, HISTORY_ROW, ContextIndex, LookupGate, LookupRound, OutputHistory,
                     load_lookup_prior)
from .models.linear import settled_weights, weights_may_change
from .policy import POLICIES, AcceptanceTables, Eagle3Policy, FittedPolicy, PaperPolicy, Plan, Policy
from .sampling import draw, draw_rows, greedy_tokens, position_uniforms, request_keys
from .timing import StageTimer, timestamp

METHODS = ("heterospec", "eagle3", "autoregressive")
# Engine(linear=...): "tuned" (CPU: the faster GEMM path per shape and row count, measured),
# "stock" (F.linear everywhere).
LINEAR_MODES = ("tuned", "stock")

PromptLike = Union[str, Sequence[int], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------
@dataclass
class RoundRecord:
    """One draft-verify round of one request."""

    accept_len: int          # accepted draft tokens (the bonus not counted)
    verified: int            # tree nodes verified, root included
    depth: int               # candidate layers drafted (base depth + 1 + extension)
    entropy: float           # H(P*), cumulative meta-path Top-K entropy
    bin: int                 # entropy bin (-1 for eagle3, which does not bin)
    tcr: int                 # rank of the deepest accepted node among selected nodes (1 = best)
    pstar_rank: int          # rank of P*'s final node among selected nodes, 0 if not selected
    pstar_accepted: bool     # P* was accepted in full
    draft_s: float
    verify_s: float
    plain: bool = False      # a plain target step chosen by the policy (no draft, one token)
    lookup: bool = False     # a context-lookup chain (heterospec.lookup), not a drafted tree
    history: bool = False    # ... copied from an earlier request (OutputHistory), not its own context
    corpus: bool = False     # ... retrieved from the lookup corpus (heterospec.datastore)


@dataclass
class GenerationStats:
    method: str
    new_tokens: int = 0
    prompt_tokens: int = 0
    rounds: int = 0              # speculative rounds (target verification calls)
    target_calls: int = 0        # target forwards after prefill
    verified_tokens: int = 0     # tokens fed to the target after prefill
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    policy_s: float = 0.0        # the policy's planning and learning (host time), whole batch
    records: List[RoundRecord] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens gained per target call (accepted drafts + bonus); 1 for autoregressive."""
        if not self.records:
            return 1.0
        return sum(r.accept_len + 1 for r in self.records) / len(self.records)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("method", "new_tokens", "prompt_tokens", "rounds", "target_calls",
                                            "verified_tokens", "prefill_s", "draft_s", "verify_s", "total_s",
                                            "policy_s")}
        d["tau"] = self.tau
        d["tokens_per_s"] = self.tokens_per_s
        d["records"] = [r.__dict__ for r in self.records]
        return d


@dataclass
class GenerationResult:
    token_ids: List[int]
    text: Optional[str]
    stats: GenerationStats
    finish_reason: str           # "eos" or "length"


# ---------------------------------------------------------------------------------------------
# Per-batch state
# ---------------------------------------------------------------------------------------------
@dataclass
class _Batch:
    prefix_lens: torch.Tensor            # [B] committed target length L_b (root sits at L_b)
    root: torch.Tensor                   # [B] last sampled token, not yet in the target cache
    target_cache: object
    draft_cache: object = None
    draft_lens: Optional[torch.Tensor] = None   # [B] draft cache length before the pending extend
    ext_tokens: Optional[torch.Tensor] = None   # [B, n] tokens of the pending draft extend
    ext_feats: Optional[torch.Tensor] = None    # [B, n, 3H] target features paired with them
    ext_num: Optional[torch.Tensor] = None      # [B] valid entries per request
    draft_hole: Optional[torch.Tensor] = None   # [B, 2] draft cache slots [lo, hi) never computed (draft_window,
                                                # cold plain steps); None until a request first drops entries
    # The draft's prompt pass, deferred from prefill to the first round that drafts (a call that
    # starts plain): ([B, n] tokens, [B, n, 3H] features, [B] entries), slots 0 .. entries - 1.
    deferred: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    # Seconds the last round spent on that deferred pass (measured; 0.0 for a round without it):
    # a one-off of the call, which the policy takes off the round's time.
    prompt_pass_s: float = 0.0
    # What a cold plain step left (Engine._cold_step): while these very tensors are still the
    # batch's (ext_tokens, draft_hole, draft_lens, ext_num), the next cold step only moves the
    # hole's end.
    cold_tail: Optional[tuple] = field(default=None, repr=False)
    host_lens: List[int] = field(default_factory=list)   # prefix_lens as the host knows them
    # [B, 2] int64 sampling keys (sampling.request_keys), None when greedy: the token at sequence
    # position s of request b is drawn with the uniform keyed to (its key, s), in any method.
    sample_keys: Optional[torch.Tensor] = None
    outputs: List[List[int]] = field(default_factory=list)
    finished: List[Optional[str]] = field(default_factory=list)
    stats: List[GenerationStats] = field(default_factory=list)
    # Row b holds the caller's request rows[b]; the lists below are in the caller's order and
    # outlive the rows (drop_finished removes finished requests' rows).
    rows: List[int] = field(default_factory=list)
    all_outputs: List[List[int]] = field(default_factory=list)
    all_stats: List[GenerationStats] = field(default_factory=list)
    all_finished: List[Optional[str]] = field(default_factory=list)
    _done: Optional[tuple] = field(default=None, repr=False)   # done_mask's (finished flags, device mask)

    @property
    def size(self) -> int:
        return self.prefix_lens.shape[0]

    def active(self) -> List[int]:
        return [b for b, f in enumerate(self.finished) if f is None]

    def done_mask(self, device) -> torch.Tensor:
        """``[B]`` bool on ``device``: the finished requests. Copied to the device only when a
        request finished (or the batch was compacted) since the last call: a replayed round
        reads it twice, and a host-to-device copy from a list is a synchronous one."""
        key = tuple(f is not None for f in self.finished)
        if self._done is None or self._done[0] != key:
            self._done = (key, torch.tensor(key, dtype=torch.bool, device=device))
        return self._done[1]

    _PER_ROW = ("prefix_lens", "root", "draft_lens", "ext_tokens", "ext_feats", "ext_num", "draft_hole", "sample_keys")

    def drop_finished(self) -> None:
        """Keep only the rows of requests still running, in every per-request tensor and both
        caches: a finished request's row would otherwise ride along in every later forward."""
        keep = self.active()
        idx = torch.tensor(keep, dtype=torch.int64, device=self.root.device)
        for name in self._PER_ROW:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, idx))
        if self.deferred is not None:
            self.deferred = tuple(t.index_select(0, idx) for t in self.deferred)
        self.target_cache.keep_rows(idx)
        if self.draft_cache is not None:
            self.draft_cache.keep_rows(idx)
        self.outputs, self.finished, self.stats, self.rows, self.host_lens = (
            [xs[b] for b in keep] for xs in (self.outputs, self.finished, self.stats, self.rows, self.host_lens))


@dataclass
class _Verdict:
    """The verified tree and what the target accepted of it."""

    tree_tokens: torch.Tensor   # [B, T] token at each tree position (root at 0)
    tree_cand: torch.Tensor     # [B, T] candidate index of each position (-1: root / padding)
    num_nodes: torch.Tensor     # [B] real positions, root included
    accept_path: torch.Tensor   # [B, T] positions of root + accepted nodes, -1 padded
    accept_len: torch.Tensor    # [B] accepted draft nodes
    bonus: torch.Tensor         # [B] the target's token after the last accepted node
    target_top1: Optional[torch.Tensor] = None   # [B, T] the target's token at each position (greedy: argmax)
    invalid: Optional[torch.Tensor] = None       # [B] sampling: tree position of an invalid row on the path, or -1


@dataclass
class _Tree:
    """A drafted candidate set and what HeteroSpec decided about it (all ``[B, ...]``)."""

    scores: torch.Tensor      # [B, C] cumulative log-scores, -inf = not drafted
    parents: torch.Tensor     # [B, C] parent candidate index, -1 = root
    tokens: torch.Tensor      # [B, C] target-vocabulary ids
    local: torch.Tensor       # [B, C] the candidate's own draft log-prob
    budget: torch.Tensor      # [B] draft nodes to verify
    depth: torch.Tensor       # [B] candidate layers drafted per request
    entropy: torch.Tensor     # [B] H(P*) per request
    bins: torch.Tensor        # [B] entropy bin per request (-1 when not binned)
    pstar: torch.Tensor       # [B] candidate index of P*'s final node per request
    path_entropy: Optional[dict] = None   # {K: [B, C]} path entropy of every candidate (traces only)
    verify_nodes: Optional[int] = None    # replayed split rounds: draft nodes the verify graph holds


@dataclass
class _Drafting:
    """A round's drafting in progress (:meth:`Engine._draft_decide`, :meth:`Engine._draft_deeper`):
    the candidate arrays of :class:`_Tree` (``[B, C]``), the frontier the next forward expands,
    and the decision so far."""

    scores: torch.Tensor
    parents: torch.Tensor
    tokens: torch.Tensor
    local: torch.Tensor
    ent_k: dict               # {K: [B, C]} path entropy of every candidate for K (ek: the op's own)
    ek: int                   # the top-k width of every topk_entropy pass
    frontier: torch.Tensor    # [B, k] candidate ids the next forward expands
    f_hidden: torch.Tensor    # [B, k, H] their parents' draft outputs
    f_slot: torch.Tensor      # [B, k] their parents' slots in the tree state (-1: the root)
    depth_limit: torch.Tensor  # [B] forwards each request drafts (its bin's; all until decided)
    budget: torch.Tensor      # [B] draft nodes to verify
    bins: torch.Tensor        # [B]
    pstar: torch.Tensor       # [B]
    state: object             # the draft's DraftTreeState
    traced: bool = False      # calibration traces: the tree keeps every K's path entropy
    cut: Optional[torch.Tensor] = None   # [B] eager rounds: the forward after which a request's
    #                           deeper layers were found dead (Engine._stop_dead_layers); None: none

    def drafts_at(self, step: int) -> torch.Tensor:
        """[B] bool: the requests that draft forward ``step`` (their bin's depth, unless cut)."""
        live = self.depth_limit >= step
        return live if self.cut is None else live & (self.cut >= step)

    @property
    def entropy(self) -> torch.Tensor:
        return self.ent_k[self.ek]

    @property
    def ks(self) -> List[int]:
        """The K whose path entropy is derived from the top-ek pass (all but ek)."""
        return sorted(set(self.ent_k) - {self.ek})


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 on this (Linux) CPU: bf16 matmuls run natively, not emulated."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def draft_dtype_candidates(device, target_dtype: torch.dtype, codes: bool = False) -> List:
    """The dtypes the draft may run in for a target on ``device`` in ``target_dtype``, the
    preferred first; :meth:`Engine.from_pretrained` times the draft in each on this machine and
    keeps the fastest (:func:`heterospec.costmodel.choose_draft_dtype`).

    The draft only proposes; what is accepted is decided by the target alone, so the draft's
    precision can never change the output (greedy or sampled), only tau. Which dtype drafts
    fastest is the CPU's business, but the draft half's time is not the whole story: twice a
    draft in a dtype other than the target's drafted faster and HeteroSpec still ran slower end
    to end - a float32 draft beside a bfloat16 target (bench/RESULTS.md, "The draft's dtype
    measured, the target's glue trimmed"), and a bfloat16 draft, once bfloat16 weights streamed,
    beside a float32 target ("Layer glue as two ops, bfloat16 weights streamed"). So where the
    target's dtype is native the draft runs in it; a half-precision target on a CPU that only
    emulates bf16 may have its draft in float32 (timed: emulated half precision is the slow
    one there). On a GPU the draft follows the target.

    ``codes`` (a CPU whose linears stream block codes: tuned linears): wherever the draft may run
    in float32, also "q8_0" - float32 with its weights rounded to 8-bit codes
    (:meth:`~heterospec.models.draft.Eagle3Draft.round_weights_q8_0_`). A CPU draft step is bound
    by reading its weights (a draft layer and head are ~20 MB in float16, read every step), so
    fewer bytes draft faster; the rounding left tau as it was on the benchmark sets
    (bench/RESULTS.md, "A streamed draft with 8-bit weights"), and timing decides as for the
    dtypes."""
    kind = getattr(device, "type", str(device)).split(":")[0]
    if kind != "cpu":
        return [target_dtype]
    if target_dtype in (torch.bfloat16, torch.float16) and not cpu_has_native_bf16():
        out = [target_dtype, torch.float32]
    else:
        out = [target_dtype]
    if codes and torch.float32 in out:
        out.append("q8_0")
    return out


# ---------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------
_DRAFT_METHODS = ("new_cache", "extend", "tree_step")
_PROMPT_KINDS = "a prompt must be a string, a list or tuple of token ids, or a 1-D integer tensor"
_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}


def _is_int(x) -> bool:
    """An integer token id or count (numpy integers and 0-d integer tensors included), not a bool
    or a float. A tensor of any shape has ``__index__`` (it raises unless the tensor is a 0-d
    integer), so tensors are judged by their shape and dtype: a 1-D tensor is a prompt, not a token."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.dtype.is_floating_point and not x.dtype.is_complex and x.dtype != torch.bool
    return not isinstance(x, bool) and hasattr(x, "__index__")


def _float_dtype(name: str, dtype, forms: tuple = ()):
    """None, a floating torch dtype, or its name ("bfloat16"), or one of ``forms`` (weight forms
    such as "q8_0", returned as they are); anything else is an error."""
    if dtype is None or dtype in forms:
        return dtype
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in _DTYPE_NAMES:
            raise ValueError(f"{name} must be one of {', '.join((*_DTYPE_NAMES, *forms))}, got {dtype!r}")
        return _DTYPE_NAMES[dtype.removeprefix("torch.")]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point dtype ({', '.join(_DTYPE_NAMES)}), got {dtype!r}")
    return dtype


def _check_tensor_prompt(prompt: torch.Tensor) -> torch.Tensor:
    """A tensor prompt: 1-D integer token ids, else a ValueError naming its shape or dtype."""
    if prompt.dim() != 1:
        raise ValueError(f"a tensor prompt must be 1-D token ids, got shape {tuple(prompt.shape)}")
    if prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
        raise ValueError(f"a tensor prompt must hold integer token ids, got {prompt.dtype}")
    return prompt


class _OptionalSetting:
    """An engine setting that is None or a ``kind``, checked when set (a descriptor: the value
    lives in the engine's ``_<name>``)."""

    def __init__(self, kind: type, kind_name: str, doc: str):
        self.kind, self.kind_name, self.__doc__ = kind, kind_name, doc

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, engine, owner=None):
        return self if engine is None else getattr(engine, "_" + self.name)

    def __set__(self, engine, value) -> None:
        if value is not None and not isinstance(value, self.kind):
            raise ValueError(f"Engine.{self.name} must be a {self.kind_name} or None, got {type(value).__name__}")
        setattr(engine, "_" + self.name, value)


class Engine:
    """Three decoding methods on one target (and one EAGLE-3 draft for the speculative ones).

    ``target``: a :class:`heterospec.TargetModel` or an in-memory ``transformers`` Llama model.
    ``draft``: a :class:`heterospec.Eagle3Draft` (``None`` allows only ``autoregressive``).
    ``config``: tree settings; default :func:`heterospec.config.default_config` for the device.
    ``bins``: entropy bins for HeteroSpec; default the calibration file next to the draft, else
    the documented fallback (with a warning).
    ``linear``: ``"tuned"`` (default) - on CPU every linear layer of both models uses, per row
    count, the faster of ``F.linear`` and oneDNN's reordered-weight linear as timed on this
    machine (:mod:`heterospec.models.linear`; the models become :class:`TunedLinear` in place);
    ``"stock"`` - ``F.linear`` only.
    ``cuda_graphs``: replay each round's draft and verification as CUDA graphs, one pair per
    configuration (:mod:`heterospec.graphs`); default on for CUDA, unavailable elsewhere.
    """

    def __init__(self, target, draft=None, *, tokenizer=None, config: Optional[SpecConfig] = None,
                 bins: Optional[EntropyBins] = None, device=None, dtype=None, max_length: Optional[int] = None,
                 attn_backend: str = "auto", draft_dir: Optional[str] = None, policy: str = "fitted",
                 tables: Optional[AcceptanceTables] = None, cost_model=None, linear: str = "tuned",
                 cuda_graphs: Optional[bool] = None, lookup: bool = True):
        from .models.linear import tune_linears, untune_linears
        from .models.target import TargetModel

        if isinstance(target, (str, os.PathLike)):
            raise ValueError(f"Engine(target): got the path {os.fspath(target)!r}; load directories with "
                             "Engine.from_pretrained(target=..., draft=...)")
        if not isinstance(target, (TargetModel, torch.nn.Module)):
            raise ValueError(f"Engine(target): expected a heterospec TargetModel or a transformers Llama model, "
                             f"got {type(target).__name__}")
        dtype = _float_dtype("dtype", dtype)
        if device is not None:
            usable_device(device, "Engine")
        if config is not None and not isinstance(config, SpecConfig):
            raise ValueError(f"Engine: config must be a heterospec.SpecConfig, got {type(config).__name__}")
        if bins is not None and not isinstance(bins, EntropyBins):
            raise ValueError(f"Engine: bins must be heterospec EntropyBins, got {type(bins).__name__}")
        if policy not in POLICIES:
            raise ValueError(f"Engine: policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not isinstance(lookup, bool):
            raise ValueError(f"Engine: lookup must be True or False, got {lookup!r}")
        if linear not in LINEAR_MODES:
            raise ValueError(f"Engine: linear must be one of {', '.join(LINEAR_MODES)}, got {linear!r}")
        if tables is not None and not isinstance(tables, AcceptanceTables):
            raise ValueError(f"Engine: tables must be heterospec AcceptanceTables, got {type(tables).__name__}")
        if draft is not None and not all(callable(getattr(draft, m, None)) for m in _DRAFT_METHODS):
            raise ValueError(f"Engine(draft): expected an Eagle3Draft (a draft with {', '.join(_DRAFT_METHODS)}), "
                             f"got {type(draft).__name__}")
        max_length = _as_int("Engine", "max_length", max_length, optional=True)
        if not isinstance(target, TargetModel):
            target = TargetModel.from_hf(target, device=device, dtype=dtype, attn_backend=attn_backend)
        self.target = target
        self.device = next(target.parameters()).device
        self.tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
        self.draft = draft
        # The draft's taps travel with every target call (not through the target's config), so
        # the features always match the draft even when the target was built or shared elsewhere.
        self._taps = None
        if draft is not None:
            self._taps = self._check_pair(target, draft)
            draft.to(self.device)
        # CPU linear layers: per weight shape and row count, the faster of MKL's F.linear and
        # oneDNN's reordered-weight linear, as measured on this machine (models/linear.py: the
        # stock path can make verifying 2-16 tokens cost 2-4x one token).
        self.linear = linear
        self.linear_report = {}
        self.draft_dtype_report = {}       # from_pretrained: how the draft's dtype was chosen
        if linear == "tuned" and self.device.type == "cpu":
            self.linear_report = tune_linears([target, draft])
        else:
            untune_linears([target, draft])       # models shared with a tuned engine before
        self.config = config if config is not None else default_config(self.device)
        self.draft_dir = draft_dir
        self._bins = bins
        # HeteroSpec's per-bin actions: "fitted" (acceptance tables of the draft + this device's
        # cost model; the paper's formulas when the draft has no tables) or "paper".
        self.policy = policy
        if tables is not None and not isinstance(tables, AcceptanceTables):
            raise ValueError(f"Engine tables must be heterospec AcceptanceTables, got {type(tables).__name__}")
        self._tables_given = tables            # set on the engine (used for any tree without a file)
        self._tables_found = {}                # top_k -> the draft directory's tables for that tree
        self._cost_model = cost_model          # a CostModel, a path, or None (cache / quick measure)
        self._persist_online = False           # True once the cost model came from this device's cache
        self._fitted = {}
        # Ragged verification (CPU): a batch's verify forward runs its linear layers on the real
        # tree tokens only, so one request's Top-N pruning saves compute at any batch size.
        self.ragged_verify = self.device.type == "cpu"
        # Capture-ready rounds (CUDA): static shapes per plan (the extend over the tree's width,
        # every draft step to the plan's depth, the verified tree padded to its capacity), no host
        # read inside the draft steps and the verify forward, and one packed device-to-host read
        # per round in _commit. On CPU, host reads are cheap and early exits save compute.
        self.static_rounds = self.device.type == "cuda"
        # Eager rounds stop drafting a request once no deeper node could enter its verified set
        # (:meth:`_stop_dead_layers`): the tree is the same, its useless draft forwards are not run.
        self.stop_dead_layers = True
        # CUDA graphs of those rounds' two halves, captured per configuration (graphs.py).
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise ValueError(f"Engine: cuda_graphs must be True, False or None, got {cuda_graphs!r}")
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        self.round_graphs = RoundGraphs(self.device) if cuda_graphs else None
        # Replayed rounds of a plan whose bins draft or verify differently split the draft half
        # at HeteroSpec's decision: one host read of the batch's deepest bin and largest budget,
        # then the graph of that (forwards, nodes). Without it every replayed round drafts and
        # verifies the plan's largest action, and the bins' actions save nothing on a GPU.
        self.bin_graphs = True
        # The tree depth a split round's buffers are sized for: the deepest plan split so far
        # (it only grows). The fitted policy's online corrections move a plan's deepest bin and
        # largest budget round by round; graphs sized per plan were a new set of captures per
        # move (~60 captures in 12 calls on an H100, with more than max_graphs keys in turn), so
        # a split round's graphs are keyed by the binning option and this envelope instead.
        self._split_depth = 0
        # How a FlashInfer target attends in replayed forwards: "sdpa" (one static masked pass over
        # the cache, captured as it is) or "split" (SplitTreeAttention: FlashInfer over the prefix,
        # planned on the host before every replay, plus the tree block). "sdpa" by default: it was
        # the faster of the two in graph mode at every tree size and context measured on an H200
        # (bench/RESULTS.md, GPU). Prefill and eager rounds use the target's own backend.
        self.graph_attention = "sdpa"
        # The draft's catch-up after plain steps: a request's pending extend keeps at most
        # 2 * draft_window entries; at that point the oldest are dropped (the newest draft_window
        # kept) and their draft cache slots become a masked hole. Unbounded, the pending target
        # features grow by B x 3H values per plain step for as long as a bucket stays plain, and
        # on CUDA every 16 more columns are another draft graph to capture. The draft still sees
        # the prompt and the latest tokens; the output never depends on it. None: catch up on
        # every token.
        self.draft_window = 16
        # Cold plain steps: where the policy's probe schedule keeps a bucket plain for at least
        # draft_window more rounds (Policy.plain_rounds_ahead), a plain step queues no catch-up
        # (the window would drop it before a round used it) and keeps only its newest entry; the
        # last draft_window plain steps before a probe are warm again, so the probe drafts from
        # the prompt and the latest tokens, as with the window alone. A call that starts plain
        # also defers the draft's pass over the prompts to its first drafted round. Eager rounds only.
        self.cold_plain = True
        # Context lookup (heterospec.lookup): with the fitted policy, a round may verify tokens
        # copied from the request's own context instead of a drafted tree, when the gate's
        # measured acceptance and the cost model say it is faster. Eager rounds only (a chain's
        # length varies round by round; CUDA graphs are captured per shape).
        # A fresh gate starts from the lookup prior shipped next to the draft, where there is one.
        vocab = getattr(getattr(target, "config", None), "vocab_size", None)
        self._lookup_prior = load_lookup_prior(draft_dir, vocab)
        self.lookup_gate: Optional[LookupGate] = self._new_gate() if lookup else None
        # ... and, opted into with `engine.lookup_history = heterospec.OutputHistory()`, from earlier requests:
        # the prompts and outputs of the calls that look up are kept for the lookups of the calls
        # after them. Off by default: on the five benchmark sets it was level with own-context
        # lookup (a gain on near-duplicate requests, none shown elsewhere; bench/RESULTS.md).
        self.lookup_history: Optional[OutputHistory] = None
        # ... and from the lookup corpus shipped next to the draft (heterospec.datastore: the
        # target's own greedy answers to the draft's training prompts, REST-style retrieval),
        # for every call that looks up; `engine.lookup_corpus = None` turns it off.
        self.lookup_corpus: Optional[CorpusIndex] = corpus_for(draft_dir, vocab) if lookup else None
        self._lookup_state_read: Optional[str] = None     # the gate's saved state taken up (path)
        self._call_gate: Optional[LookupGate] = None       # generate(lookup=True) on such an engine
        # batch size -> SplitTreeAttention (graph_attention "split", or a factory set by tests)
        self.split_attention_factory, self._split = None, {}
        self._graph_sdpa = None
        self._kept_caches = {}       # with graphs: id(model) -> (KV cache, its k, its v) kept between calls
        limit = int(getattr(target.config, "max_position_embeddings", 0) or 0) or 4096
        rotary = getattr(target, "rotary", None)
        if getattr(rotary, "exact_length", None):
            limit = min(limit, rotary.exact_length)       # longrope: its original (short) context
        self.max_length = max_length if max_length is not None else limit

    def _new_gate(self) -> LookupGate:
        """A lookup gate, seeded from the draft's lookup prior where it ships one."""
        gate = LookupGate()
        if self._lookup_prior is not None:
            gate.seed(self._lookup_prior)
        return gate

    # Settings a user may change on a built engine (README: ``engine.lookup_history = ...``) are
    # checked when set, as the constructor checks them: a wrong value named at once, not met as an
    # AttributeError inside a round or, for the policy, silently read as another one.
    @property
    def policy(self):
        """HeteroSpec's per-bin actions for calls that name none: "fitted", "paper" or a
        :class:`heterospec.policy.Policy`."""
        return self._policy_name

    @policy.setter
    def policy(self, value) -> None:
        if not isinstance(value, Policy) and value not in POLICIES:
            raise ValueError(f"Engine.policy must be one of {', '.join(POLICIES)} or a heterospec Policy, "
                             f"got {value!r}")
        self._policy_name = value

    lookup_history = _OptionalSetting(OutputHistory, "heterospec.OutputHistory",
                                      "Earlier requests' prompts and outputs that lookups may copy from (None: off).")
    lookup_corpus = _OptionalSetting(CorpusIndex, "heterospec.CorpusIndex",
                                     "The lookup corpus lookups may retrieve chains from (None: off).")

    @property
    def max_length(self) -> int:
        """The longest prompt + output a call may hold (its KV caches' length)."""
        return self._max_length

    @max_length.setter
    def max_length(self, value: int) -> None:
        value = _as_int("Engine", "max_length", value)
        if value < 2:
            raise ValueError(f"max_length must be >= 2, got {value}")
        for model, what in ((self.target, "target"), (self.draft, "draft")):
            if hasattr(getattr(model, "rotary", None), "check_length"):
                model.rotary.check_length(value, f"Engine {what}")
        self._max_length = value

    @property
    def draft_window(self) -> Optional[int]:
        """Entries of the draft's catch-up kept after a long plain stretch (see __init__)."""
        return self._draft_window

    @draft_window.setter
    def draft_window(self, value: Optional[int]) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"Engine.draft_window must be None or an int >= 1, got {value!r}")
        self._draft_window = value

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, target: Optional[str] = None, draft: Optional[str] = None, device="cpu",
                        dtype=None, config: Optional[SpecConfig] = None, draft_dtype=None,
                        **kwargs) -> "Engine":
        """Load a target directory and an EAGLE-3 draft directory; no arguments = the built-in pair.

        ``draft_dtype``: the draft's weights: a dtype, or "q8_0" (float32, weights rounded to
        8-bit codes). Default: the target's dtype, except on a CPU: a half-precision target on a
        CPU that emulates bf16 is timed with its draft in that dtype and in float32, and with tuned
        linears every float32 candidate also as "q8_0" (:func:`draft_dtype_candidates`); the draft
        runs in the fastest, a choice cached per machine (``engine.draft_dtype_report`` says
        what was measured).

        ``freeze_gc`` (default True): collect once and move every Python object alive then out of
        the cyclic collector's reach (:func:`gc.freeze`, as serving engines do after start-up).
        The models, tokenizer and tables are ~370K objects that live as long as the engine; a
        full collection scans them all (~150 ms on a 2-core CPU), and the first one fell inside
        a round of the first call, which the policy then timed (bench/RESULTS.md, sixty-fourth
        session). Later collections scan only newer objects."""
        from .models.draft import Eagle3Draft
        from .models.linear import block_codes_available
        from .models.target import TargetModel

        dtype, draft_dtype = _float_dtype("dtype", dtype), _float_dtype("draft_dtype", draft_dtype, ("q8_0",))
        usable_device(device, "Engine.from_pretrained")
        freeze_gc = kwargs.pop("freeze_gc", True)
        if not isinstance(freeze_gc, bool):
            raise ValueError(f"freeze_gc must be True or False, got {freeze_gc!r}")
        if target is None:
            from .defaults import default_draft_dir, default_target_dir
            target = default_target_dir()
            draft = default_draft_dir() if draft is None else draft
        tgt = TargetModel.from_pretrained(target, device=device, dtype=dtype,
                                          attn_backend=kwargs.pop("attn_backend", "auto"))
        drf, w = None, tgt.lm_head.weight
        codes = kwargs.get("linear", "tuned") == "tuned" and w.device.type == "cpu" and block_codes_available()
        dtypes = [draft_dtype] if draft_dtype is not None else draft_dtype_candidates(w.device, w.dtype, codes)
        if draft is not None:
            # Several candidates (or q8_0): load in float32, which holds a float16 / bfloat16 file
            # exactly, so that every candidate is converted from the file's own values.
            load = torch.float32 if len(dtypes) > 1 or dtypes[0] == "q8_0" else dtypes[0]
            drf = Eagle3Draft.from_pretrained(draft, target=tgt, dtype=load)
            drf.to(device=w.device)
            if dtypes == ["q8_0"]:
                drf.round_weights_q8_0_()
        engine = cls(tgt, drf, config=config, draft_dir=draft, **kwargs)
        if drf is not None and len(dtypes) > 1:
            from .costmodel import choose_draft_dtype
            engine.draft_dtype_report = choose_draft_dtype(engine, dtypes)
        if freeze_gc:
            gc.collect()
            gc.freeze()
        return engine

    @staticmethod
    def _check_pair(target, draft) -> Optional[tuple]:
        """Raise on a draft that cannot serve this target; return the target layers it taps."""
        tc, dc = target.config, draft.config
        t_hidden = getattr(dc, "target_hidden_size", None) or dc.hidden_size
        if t_hidden != tc.hidden_size:
            raise ValueError(f"draft was trained for a target with hidden size {t_hidden}, "
                             f"but this target's hidden size is {tc.hidden_size}")
        if dc.vocab_size != tc.vocab_size:
            raise ValueError(f"draft was trained for a target vocabulary of {dc.vocab_size} tokens, "
                             f"but this target has {tc.vocab_size}")
        aux = draft.aux_layers(tc.num_layers) if hasattr(draft, "aux_layers") else None
        if aux is not None and any(not 0 <= a <= tc.num_layers for a in aux):
            raise ValueError(f"draft taps target layers {aux}, but the target has {tc.num_layers} layers")
        return None if aux is None else tuple(aux)

    @property
    def bins(self) -> EntropyBins:
        if self._bins is None:
            self._bins = EntropyBins.find(self.draft_dir, self.config)
            tree = self._bins.provenance.get("tree") or {}
            seen = (tree.get("depth"), tree.get("entropy_k"))
            want = (self.config.depth, self.config.resolved_entropy_k)
            if tree and seen != want:
                # H(P*) sums depth + 1 per-step entropies of log(K) at most: its scale moves with both.
                warnings.warn(f"entropy bins were calibrated with depth {seen[0]} and K {seen[1]}, this engine "
                              f"drafts with depth {want[0]} and K {want[1]}; recalibrate (`heterospec calibrate`) "
                              "for meaningful bins", stacklevel=2)
        return self._bins

    @bins.setter
    def bins(self, value: EntropyBins) -> None:
        if value is not None and not isinstance(value, EntropyBins):
            raise ValueError(f"Engine.bins must be heterospec EntropyBins, got {type(value).__name__}")
        self._bins = value

    @property
    def tables(self) -> Optional[AcceptanceTables]:
        """The draft's acceptance tables for this engine's tree (``acceptance_tables_k<top_k>.json``
        next to it, else ``acceptance_tables.json``), if any."""
        return self.tables_for(self.config.top_k)

    @tables.setter
    def tables(self, value: Optional[AcceptanceTables]) -> None:
        if value is not None and not isinstance(value, AcceptanceTables):
            raise ValueError(f"Engine.tables must be heterospec AcceptanceTables, got {type(value).__name__}")
        self._tables_given, self._tables_found = value, {}
        self._fitted = {}

    def tables_for(self, top_k: int) -> Optional[AcceptanceTables]:
        """Acceptance tables for a tree of ``top_k`` (a call's own config may differ from the
        engine's): tables set on the engine for it, else the draft's file for it, else any."""
        given = self._tables_given
        if given is not None and given.top_k == top_k:
            return given
        if top_k not in self._tables_found:
            self._tables_found[top_k] = AcceptanceTables.find(self.draft_dir, top_k)
        found = self._tables_found[top_k]
        return given if given is not None and (found is None or found.top_k != top_k) else found

    @property
    def cost_model(self):
        """This device's cost model: the one given, else the cached one measured here, else a
        quick measurement (seconds), cached for next time (:mod:`heterospec.costmodel`)."""
        from . import costmodel
        if not isinstance(self._cost_model, costmodel.CostModel):
            self._cost_model = costmodel.for_engine(self, self._cost_model)
            self._persist_online = True
        return self._cost_model

    @cost_model.setter
    def cost_model(self, value) -> None:
        from .costmodel import CostModel
        if value is not None and not isinstance(value, (CostModel, str, os.PathLike)):
            raise ValueError(f"Engine.cost_model must be a heterospec CostModel, the path of a cost file or None, "
                             f"got {type(value).__name__}")
        self._cost_model = value
        self._persist_online = False
        self._fitted = {}

    # -- public API -----------------------------------------------------------------------------
    def generate(self, prompt: PromptLike, max_new_tokens: int = 256, method: str = "heterospec",
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None,
                 chat: bool = True, stream: Optional[Callable[[List[int]], None]] = None,
                 config: Optional[SpecConfig] = None, policy: Optional[str] = None,
                 lookup: Optional[bool] = None, corpus: Optional[bool] = None) -> GenerationResult:
        """Generate for one prompt (a string, a list of token ids or a 1-D tensor).

        ``top_k`` / ``top_p`` / ``temperature`` process the *target's* distribution (sampling);
        the tree's branching factor is ``config.top_k``. ``stream`` receives the new token ids
        after every round. ``policy`` (HeteroSpec only): ``"fitted"``, ``"paper"`` or a
        :class:`heterospec.policy.Policy` (default: the engine's). ``lookup`` (HeteroSpec with
        the fitted policy): whether rounds may verify chains copied from the context
        (:mod:`heterospec.lookup`); None: the engine's setting (``Engine(lookup=...)``).
        ``corpus``: whether those chains may also come from the lookup corpus
        (:mod:`heterospec.datastore`, ``engine.lookup_corpus``); None: where the engine has one.
        """
        cb = (lambda b, toks: stream(toks)) if stream is not None else None
        if not isinstance(prompt, (str, list, tuple, torch.Tensor)):
            raise ValueError(f"{_PROMPT_KINDS}; got {type(prompt).__name__}")
        if isinstance(prompt, torch.Tensor):      # here: a 0-d one would read as a batch of token ids
            _check_tensor_prompt(prompt)
        return self.generate_batch([prompt], max_new_tokens, method, temperature, top_p, top_k, seed,
                                   chat, cb, config, policy, lookup, corpus)[0]

    def generate_batch(self, prompts: Sequence[PromptLike], max_new_tokens: int = 256,
                       method: str = "heterospec", temperature: float = 0.0, top_p: float = 1.0,
                       top_k: int = 0, seed: Optional[int] = None, chat: bool = True,
                       stream: Optional[Callable[[int, List[int]], None]] = None,
                       config: Optional[SpecConfig] = None, policy: Optional[str] = None,
                       lookup: Optional[bool] = None, corpus: Optional[bool] = None) -> List[GenerationResult]:
        """Generate for several prompts at once; every request gets its own tree each round."""
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        if method != "autoregressive" and self.draft is None:
            raise ValueError(f"method {method!r} needs a draft model; this engine has none")
        max_new_tokens = _as_int("generate", "max_new_tokens", max_new_tokens)
        if max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
        if (isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, collections.abc.Sequence)
                or (len(prompts) > 0 and all(_is_int(t) for t in prompts))):
            raise ValueError("generate_batch takes a list of prompts (strings, token-id lists or 1-D tensors); "
                             "for a single prompt use generate()")
        if config is not None and not isinstance(config, SpecConfig):
            raise ValueError(f"config must be a heterospec.SpecConfig, got {type(config).__name__}")
        if lookup is not None and not isinstance(lookup, bool):
            raise ValueError(f"lookup must be True, False or None, got {lookup!r}")
        if corpus is not None and not isinstance(corpus, bool):
            raise ValueError(f"corpus must be True, False or None, got {corpus!r}")
        if corpus and self.lookup_corpus is None:
            raise ValueError("corpus=True: this engine has no lookup corpus (engine.lookup_corpus is None; "
                             f"the draft directory has no {CORPUS_FILE}, or the engine was built with lookup=False)")
        if policy is not None and not isinstance(policy, Policy) and policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)} or a heterospec Policy, got {policy!r}")
        params = SamplingParams(temperature, top_p, top_k, seed)
        cfg = config if config is not None else self.config
        if len(prompts) == 0:
            raise ValueError("generate_batch: no prompts given")
        ids = [self._encode(p, chat) for p in prompts]
        pol = self._policy(method, cfg, policy or self.policy)
        B = len(ids)
        if pol is not None:
            pol.new_requests(B)         # new contexts: what the guard measured was another prompt's
        speculative = pol is not None and pol.needs_draft(B)
        tree_cap = pol.max_tree_nodes(B) + 1 if speculative else 1
        # Context lookup: the fitted policy's rounds may verify chains copied from the context.
        gate = None
        if isinstance(pol, FittedPolicy) and not self.static_rounds and lookup is not False:
            gate = self.lookup_gate
            if gate is None and lookup:      # asked for by this call on an engine built without it
                gate = self._call_gate = self._call_gate or self._new_gate()
        gate_path = _lookup_state_path(pol) if gate is not None else None
        if gate_path is not None and self._lookup_state_read != gate_path:
            self._lookup_state_read = gate_path       # what an earlier process learned here, once
            gate.load(gate_path)
        if gate is not None:
            tree_cap = max(tree_cap, gate.kmax + 1)
        for i, p in enumerate(ids):
            if len(p) + max_new_tokens > self.max_length:
                which = "the prompt" if len(ids) == 1 else f"prompt {i}"
                raise ValueError(f"{which} has {len(p)} tokens; with max_new_tokens={max_new_tokens} that is "
                                 f"{len(p) + max_new_tokens} > max_length={self.max_length}")
        # A request that finishes inside an accepted path has moved past max_new_tokens by up to
        # a tree, and a later round still writes a (root-only, padded) tree after it: two trees.
        cache_len = max(len(p) for p in ids) + max_new_tokens + 2 * tree_cap + 1
        keys = None if params.greedy else request_keys(params.seed, len(ids), self.device)

        policy_s = 0.0
        # settled_weights: the models' weights are checked at the call's first forward and after
        # every stream callback (user code), not at every forward (models.linear.settled_weights)
        with torch.inference_mode(), settled_weights():
            t0 = time.perf_counter()
            # A call that starts plain defers the draft's prompt pass to its first drafted round
            # (none, if it stays plain; fewer rows, if requests finished by then).
            defer = self.cold_plain and speculative and not self.static_rounds and not pol.plan(B).speculate
            st = self._prefill(ids, method, params, keys, cache_len, max_new_tokens, stream, speculative,
                               defer_prompt=defer)
            index = [ContextIndex(p) for p in ids] if gate is not None else None
            # The engine's output history, with the engine's gate (a call's own gate has none).
            history = self.lookup_history if gate is not None and gate is self.lookup_gate else None
            retrieve = self.lookup_corpus if gate is not None and corpus is not False else None
            keys = [OutputHistory.key(p) for p in ids] if history is not None else None
            # The first plain step after a speculative or lookup round runs slower than plain
            # steps after plain steps (its caches and paths were the round's): a cost of the
            # switch, not of plain decoding, so it is not timed for the policy (which probes
            # two plain steps). Timed, it put a bfloat16 batch-2 plain step 18 % above the
            # steady one, and the guard let speculation lose 14 % (bench/RESULTS.md, sixty-second
            # session). So is the first step after the prefill (its caches were the prefill's;
            # 0.5-5 ms over the call's later plain steps at batch 1 on the Zen 4 box): a
            # speculating bucket times few plain steps, and one such step per call would weigh
            # in its guard's plain rate as much as its probes (bench/RESULTS.md, sixty-third
            # session).
            switched = True
            while st.active():
                # The policy's plan for the requests still running: a tree, or one plain step.
                active = st.active()
                least = min(len(st.outputs[b]) for b in active)
                if self._compaction_pays(st.size, len(active), max_new_tokens - least):
                    # Finished requests leave the batch (the later rounds cost, the plan prices
                    # and the policy times what the requests still running need).
                    st.drop_finished()
                    active = st.active()
                # A static batch ends with its slowest request: the guard judges a round by how
                # far it moved the slowest one (_progress; ``behind``: the requests at ``least``).
                behind = [b for b in active if len(st.outputs[b]) == least]
                riding = len(active) < st.size     # finished rows still in the forwards: untimed
                context = sum(st.stats[b].prompt_tokens + len(st.outputs[b]) for b in active) // max(len(active), 1)
                # Without a draft (the policy planned plain steps for this call) plain steps are
                # still timed against the plan, so the policy learns what they really cost.
                plan, chosen, one_offs = None, None, self._graph_one_offs()
                if gate is not None:        # context lookup first: a copied chain, if it pays
                    tp = time.perf_counter()
                    chosen = self._lookup_choice(st, index, ids, history, keys, retrieve, pol, gate, context,
                                                 max_new_tokens)
                    policy_s += time.perf_counter() - tp
                if chosen is not None:
                    # Verify the copied chains (a chain-shaped tree); the draft, if any, catches up later.
                    t_round = time.perf_counter()
                    tree = self._lookup_tree(st, chosen)
                    verdict = self._verify(st, tree, None, params, max_nodes=int(tree.budget.max()),
                                           append_pending=True)
                    self._commit(st, tree, verdict, max_new_tokens, stream, 0.0,
                                 time.perf_counter() - t_round, lookup=True)
                    switched = True
                    for b in active:
                        if chosen.buckets[b] >= CORPUS_ROW:
                            st.stats[b].records[-1].corpus = True
                        elif chosen.buckets[b] >= HISTORY_ROW:
                            st.stats[b].records[-1].history = True
                    tp = time.perf_counter()
                    gate.observe(chosen, [st.stats[b].records[-1].accept_len if b in active else 0
                                          for b in range(len(chosen.chains))],
                                 self._round_seconds(t_round, one_offs, riding))
                    policy_s += time.perf_counter() - tp
                    continue
                # What the draft would first catch up on (a host read: not on static rounds), read
                # at most once a round: by the policy where the round would speculate, and below.
                catchup = None if self.static_rounds or not speculative else \
                    functools.cache(functools.partial(self._catchup_tokens, st, active))
                tp = time.perf_counter()
                if pol is not None:
                    plan = (pol.round_plan(len(active), context, tokens_left=max_new_tokens - least, catchup=catchup,
                                           timed=not riding)
                            if speculative else pol.plan(len(active), context))
                    policy_s += time.perf_counter() - tp
                if plan is None or not plan.speculate or not speculative:
                    t_plain = time.perf_counter()
                    # Cold while the probe schedule keeps this bucket plain for draft_window more
                    # rounds: no catch-up queued that the window would drop before it is used.
                    cold = (self.cold_plain and speculative and plan is not None and not self.static_rounds
                            and self.draft_window is not None and pol.plain_rounds_ahead(len(active)) >= self.draft_window)
                    self._decode_one(st, params, max_new_tokens, stream, record=method != "autoregressive",
                                     cold=cold)
                    if plan is not None and hasattr(pol, "observe"):     # plain steps are timed too
                        seconds = None if switched else self._round_seconds(t_plain, one_offs, riding)
                        tp = time.perf_counter()
                        pol.observe(plan, [], [], seconds, progress=_progress(st, behind, least),
                                    batch_size=len(active), context=context)
                        if gate is not None:
                            gate.observe_plain(seconds, pol.costs.plain_ms(len(active), FittedPolicy.context_bucket(context)),
                                               FittedPolicy.bucket(len(active)))
                        policy_s += time.perf_counter() - tp
                    switched = False
                else:
                    pending = None if catchup is None else catchup()     # tokens the draft catches up on
                    # (of which the deferred prompt pass, if this round runs it: timed, not priced)
                    deferred = 0.0 if st.deferred is None or pending is None else \
                        float(st.deferred[2][active].float().mean())
                    t_draft = time.perf_counter()
                    # Draft / verify split: CUDA events, read after the round's one host read.
                    timer = StageTimer(self.device)
                    with sync_free() if self.static_rounds else contextlib.nullcontext():
                        tree = self._draft_half(st, cfg, plan)
                        timer.mark("draft")
                        verdict = self._verify_half(st, tree, plan, params)
                        timer.mark("verify")
                    self._commit(st, tree, verdict, max_new_tokens, stream, timer)
                    switched = True
                    if hasattr(pol, "observe"):   # the fitted policy learns this workload and device
                        recs = [st.stats[b].records[-1] for b in active]
                        seconds = self._round_seconds(t_draft, one_offs, riding)
                        prompt_s, st.prompt_pass_s = st.prompt_pass_s, 0.0
                        tp = time.perf_counter()
                        pol.observe(plan, [r.bin for r in recs], [r.accept_len for r in recs], seconds,
                                    extend_tokens=None if pending is None else pending - deferred,
                                    one_off_s=prompt_s, progress=_progress(st, behind, least),
                                    batch_size=len(active), context=context)
                        policy_s += time.perf_counter() - tp
            # For the lookups of later calls: only the calls that look up feed it (~3 ms of Python
            # a request, which no other method is charged).
            if history is not None:
                for p, out in zip(ids, st.all_outputs):
                    history.add(p, out)
            total = time.perf_counter() - t0
        # What it learned about this workload, for the next process (at most every SAVE_EVERY_S
        # seconds a file; the newest state at exit).
        if isinstance(pol, FittedPolicy) and pol.state_path is not None:
            save_throttled(pol.state_path, pol.save_state)
        if gate_path is not None:
            save_throttled(gate_path, functools.partial(gate.save, gate_path))
        results = []
        for out, s, reason in zip(st.all_outputs, st.all_stats, st.all_finished):
            s.total_s, s.policy_s = total, policy_s
            s.new_tokens = len(out)
            text = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer else None
            results.append(GenerationResult(out, text, s, reason or "length"))
        return results

    def calibrate(self, prompts: Sequence[PromptLike], max_new_tokens: int = 128, label: str = "tcr",
                  source: str = "user prompts", save: bool = False, progress: bool = True) -> EntropyBins:
        """Fit HeteroSpec's entropy bins on ``prompts`` (see :mod:`heterospec.calibrate`).

        With ``save=True`` the bins are written next to the draft (``entropy_bins.json``), where
        :meth:`from_pretrained` finds them.
        """
        from .calibrate import calibrate

        if save and not self.draft_dir:
            raise ValueError("calibrate(save=True) needs the draft's directory; this draft was built in memory")
        return calibrate(self, prompts, max_new_tokens=max_new_tokens, label=label, source=source,
                         out_dir=self.draft_dir if save else None, progress=progress)

    # -- inputs -----------------------------------------------------------------------------------
    def _encode(self, prompt: PromptLike, chat: bool) -> List[int]:
        vocab = self.target.config.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a string prompt needs a tokenizer; pass token ids or a tokenizer")
            if not prompt.strip():
                raise ValueError("empty prompt")
            if chat and getattr(self.tokenizer, "chat_template", None):
                ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                         add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "keys"):
                    ids = ids["input_ids"]
            else:
                ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, torch.Tensor):
            ids = _check_tensor_prompt(prompt).tolist()
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            if not all(_is_int(t) for t in ids):
                raise ValueError("a list prompt must hold integer token ids")
        else:
            raise ValueError(f"{_PROMPT_KINDS}; got {type(prompt).__name__}")
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def _policy(self, method: str, cfg: SpecConfig, policy="fitted") -> Optional[Policy]:
        """The per-round decision maker of ``method``: none (autoregressive), EAGLE-3's fixed tree,
        or HeteroSpec's fitted / paper policy. "fitted" needs the draft's acceptance tables
        measured with this tree's top_k; without them HeteroSpec follows the paper."""
        if method == "autoregressive":
            return None
        if method == "eagle3":
            return Eagle3Policy(cfg)
        if isinstance(policy, Policy):
            return policy
        if policy == "fitted":
            tables = self.tables_for(cfg.top_k)
            if tables is not None and tables.top_k == cfg.top_k:
                key = (cfg.top_k, cfg.total_tokens, self.static_rounds and not self.bin_graphs)
                if key not in self._fitted:
                    cost = self.cost_model
                    # rounds of one shape per plan (static, unsplit) cost their plan's largest action
                    self._fitted[key] = FittedPolicy(tables, cost, cfg, ragged=self.ragged_verify,
                                                     state_path=self._online_state_path(tables, cfg),
                                                     static=self.static_rounds and not self.bin_graphs)
                return self._fitted[key]
            why = ("has no acceptance tables (`heterospec calibrate`)" if tables is None else
                   f"has acceptance tables for tree top_k {tables.top_k}, not {cfg.top_k}")
            _warn_once(f"the draft {why}: HeteroSpec uses the paper's per-bin actions (policy='paper')")
        return PaperPolicy(self.bins, cfg)

    def _online_state_path(self, tables: AcceptanceTables, cfg: SpecConfig) -> Optional[str]:
        """Where the fitted policy's online corrections for this device, draft and tree live: next
        to the cached cost model of this device (None for a cost model given in memory)."""
        from . import costmodel
        cm = self._cost_model
        if not self._persist_online or not isinstance(cm, costmodel.CostModel) or not cm.fingerprint:
            return None
        key = hashlib.sha1(json.dumps([tables.provenance.get("date"), tables.provenance.get("rounds"),
                                       cfg.top_k, cfg.total_tokens], sort_keys=True).encode()).hexdigest()[:12]
        return costmodel.online_state_path(costmodel.cache_path(cm.fingerprint), key)

    # -- prefill --------------------------------------------------------------------------------
    def _prefill(self, ids: List[List[int]], method: str, params: SamplingParams, keys, cache_len: int,
                 max_new_tokens: int, stream, speculative: Optional[bool] = None,
                 draft_prompt: bool = True, defer_prompt: bool = False) -> _Batch:
        """Prefill the target (and, speculating with ``draft_prompt``, the draft over the prompt:
        every draft entry but the last, whose output the first round drafts from; otherwise the
        whole prompt stays pending for the first round's extend). ``defer_prompt`` (eager rounds,
        a call that starts plain): that pass runs at the start of the first round that drafts,
        over the rows still there (:attr:`_Batch.deferred`), and not at all if none does."""
        B, n_max, dev = len(ids), max(len(p) for p in ids), self.device
        lens = torch.tensor([len(p) for p in ids], device=dev)
        tokens = torch.zeros(B, n_max, dtype=torch.int64, device=dev)
        for b, p in enumerate(ids):
            tokens[b, :len(p)] = torch.tensor(p, device=dev)
        positions = torch.arange(n_max, device=dev).expand(B, n_max)
        t0 = time.perf_counter()
        tcache = self._new_cache(self.target, B, cache_len)
        zeros = torch.zeros(B, dtype=torch.int64, device=dev)
        if speculative is None:
            speculative = method != "autoregressive"
        # Ragged on CPU: the linear layers run on the prompts' real tokens, not on every prompt
        # padded to the longest (the padding grows with the batch's spread of prompt lengths).
        logits, feats = self.target(tokens, positions, tcache, zeros, None, lens, return_features=speculative,
                                    logits_index=(lens - 1)[:, None], taps=self._taps, ragged=self.ragged_verify)
        last = logits[:, 0]                                                      # [B, V]
        first = self._pick(last, params, keys, lens)                              # [B], at position lens

        outputs, stats = [[] for _ in range(B)], [GenerationStats(method, prompt_tokens=len(p)) for p in ids]
        st = _Batch(prefix_lens=lens.clone(), root=first, target_cache=tcache, host_lens=[len(p) for p in ids],
                    sample_keys=keys,
                    outputs=list(outputs),
                    finished=[None] * B, stats=list(stats), rows=list(range(B)), all_outputs=outputs,
                    all_stats=stats, all_finished=[None] * B)
        if speculative:
            # The draft entry at position p pairs the target feature at p with the token at p + 1.
            st.draft_cache = self._new_cache(self.draft, B, cache_len)
            st.draft_lens = torch.zeros(B, dtype=torch.int64, device=dev)
            st.ext_tokens = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
            st.ext_tokens[torch.arange(B, device=dev), lens - 1] = first
            st.ext_feats = feats
            st.ext_num = lens.clone()
            if draft_prompt and n_max > 1:
                # Not pending for the first round: a plain stretch before it (a plain plan) would
                # drop it from the draft's context (draft_window, cold plain steps).
                if defer_prompt:
                    st.deferred = (st.ext_tokens[:, :n_max - 1], feats[:, :n_max - 1], lens - 1)
                else:
                    self.draft.extend(st.ext_tokens[:, :n_max - 1], feats[:, :n_max - 1], st.draft_cache,
                                      st.draft_lens, lens - 1)
                rows = torch.arange(B, device=dev)
                st.draft_lens = lens - 1
                st.ext_tokens, st.ext_feats = first[:, None], feats[rows, lens - 1][:, None]
                st.ext_num = torch.ones_like(lens)
        elapsed = time.perf_counter() - t0
        for b in range(B):
            st.stats[b].prefill_s = elapsed
        self._emit(st, [[int(t)] for t in first.tolist()], max_new_tokens, stream)
        return st

    def _new_cache(self, model, batch_size: int, length: int):
        """A KV cache for ``model``. With CUDA graphs the caches are kept between calls (their
        storage is baked into the graphs): a call of the same batch size that fits the kept cache
        with at most ``_CACHE_SLACK`` (or its own length, if more) slots to spare reuses it,
        cleared, and replays the graphs captured by earlier calls instead of capturing them again.
        Exact-length reuse was not enough: the three methods of one prompt need caches of
        different lengths (their trees differ), so interleaved calls reallocated every time and
        recaptured every graph (a capture costs ~30 rounds). The spare slots cost attention reads
        only (on CUDA the attention reads every slot of the cache); a much smaller call gets a
        cache of its own."""
        if self.round_graphs is None:
            return model.new_cache(batch_size, length)
        kept = self._kept_caches.get(id(model))
        if kept is not None and kept[1].shape[1] == batch_size and \
                length <= kept[1].shape[2] <= length + max(length, _CACHE_SLACK):
            cache, k, v = kept
            cache.k, cache.v = k.zero_(), v.zero_()   # its own storage (dropping finished rows rebinds it)
            return cache
        rounded = -(-length // _CACHE_BUCKET) * _CACHE_BUCKET
        if kept is not None and kept[1].shape[1] == batch_size and kept[1].shape[2] < length:
            # Outgrown: twice the kept length (if more), so that calls of growing length drop
            # the graphs a logarithmic number of times, not once per 256 slots.
            rounded = max(rounded, 2 * kept[1].shape[2])
        length = rounded if rounded <= max(length, self.max_length) else length   # within the model's limit
        self._kept_caches[id(model)] = None          # let the old one go before allocating
        cache = model.new_cache(batch_size, length)
        self._kept_caches[id(model)] = (cache, cache.k, cache.v)
        return cache

    def _pick(self, logits: torch.Tensor, params: SamplingParams, keys: Optional[torch.Tensor],
              positions: torch.Tensor) -> torch.Tensor:
        """The token of each row of ``logits [B, V]``, which sits at sequence ``positions [B]``:
        the argmax (greedy), or the draw with the requests' keyed uniforms for those positions."""
        if params.greedy:
            return greedy_tokens(logits)
        return draw(logits, params, position_uniforms(keys, positions))

    # -- autoregressive ---------------------------------------------------------------------------
    def _decode_one(self, st: _Batch, params: SamplingParams, max_new_tokens: int, stream,
                    record: bool = False, cold: bool = False) -> None:
        """One plain target step. With a draft in use (a plain round chosen by the policy) the
        root's features join the draft's pending extend, so a later round drafts from there.
        A *cold* step (eager rounds) keeps only the newest entry pending: the entries before it
        join the request's hole, as the draft window would drop them before any round used them."""
        t0 = time.perf_counter()
        drafting = st.ext_tokens is not None
        root, feat = self._plain_step(st, params, drafting)
        if drafting and cold:      # (the old lengths: the new entry's position)
            stepped, st.prefix_lens = st.prefix_lens, st.prefix_lens + 1
        else:
            st.prefix_lens += 1
        st.host_lens = [n + 1 for n in st.host_lens]
        st.root = root
        if drafting and cold:
            self._cold_step(st, root, feat, stepped)
        elif drafting:   # entry ext_num[b]: the old root's feature, paired with the new token
            B, n = st.ext_tokens.shape
            rows = torch.arange(B, device=self.device)
            keep = self.draft_window
            cap = 2 * keep if keep else 0
            # Static rounds (CUDA) grow the pending extend by one column up to the cap, a shape
            # known without a host read (and drop rows' oldest entries there, on the device);
            # elsewhere it grows geometrically, so a long plain stretch copies the pending
            # features O(n) times in all, not O(n^2).
            if self.static_rounds:
                full = bool(cap) and n >= cap
                if full:
                    self._forget_oldest_pending(st, cap, keep)
                grow = 0 if full else 1
            else:
                most = int(st.ext_num.max())
                if cap and most >= cap:
                    self._forget_oldest_pending(st, cap, keep)
                    most = int(st.ext_num.max())
                grow = 0 if most < n else max(min(n, cap - n) if cap else n, 1)
            if grow:
                st.ext_tokens = torch.cat([st.ext_tokens, st.ext_tokens.new_zeros(B, grow)], dim=1)
                st.ext_feats = torch.cat([st.ext_feats, st.ext_feats.new_zeros(B, grow, st.ext_feats.shape[-1])],
                                         dim=1)
            st.ext_tokens[rows, st.ext_num] = st.root
            st.ext_feats[rows, st.ext_num] = feat
            st.ext_num = st.ext_num + 1
        dt = time.perf_counter() - t0
        # One record for the step's requests (they are alike, and nothing changes a plain record)
        rec = RoundRecord(accept_len=0, verified=1, depth=0, entropy=float("nan"), bin=-1, tcr=1, pstar_rank=0,
                          pstar_accepted=False, draft_s=0.0, verify_s=dt, plain=True) if record else None
        for b in st.active():
            s = st.stats[b]
            s.target_calls += 1
            s.verified_tokens += 1
            s.verify_s += dt
            if record:
                s.records.append(rec)
        self._emit(st, [[int(t)] for t in st.root.tolist()], max_new_tokens, stream)

    def _append_pending(self, st: _Batch, tokens: torch.Tensor, feats: torch.Tensor, num: torch.Tensor) -> None:
        """Each request's first ``num[b]`` entries of ``tokens`` / ``feats`` ([B, P], [B, P, F])
        join its pending draft extend after the ``ext_num[b]`` already there (eager rounds)."""
        B, P = tokens.shape
        idx = st.ext_num[:, None] + torch.arange(P, device=tokens.device)[None, :]        # [B, P]
        ext_tokens = torch.cat([st.ext_tokens, st.ext_tokens.new_zeros(B, P)], dim=1).scatter_(1, idx, tokens)
        F = st.ext_feats.shape[-1]
        ext_feats = torch.cat([st.ext_feats, st.ext_feats.new_zeros(B, P, F)], dim=1)
        ext_feats.scatter_(1, idx[:, :, None].expand(-1, -1, F), feats.to(ext_feats.dtype))
        st.ext_num = st.ext_num + num
        width = max(int(st.ext_num.max()), 1)
        st.ext_tokens, st.ext_feats = ext_tokens[:, :width], ext_feats[:, :width]
        keep = self.draft_window
        if keep and int(st.ext_num.max()) >= 2 * keep:
            self._forget_oldest_pending(st, 2 * keep, keep)
            width = max(int(st.ext_num.max()), 1)
            st.ext_tokens, st.ext_feats = st.ext_tokens[:, :width], st.ext_feats[:, :width]

    @staticmethod
    def _forget_oldest_pending(st: _Batch, cap: int, keep: int) -> None:
        """Requests with ``cap`` or more pending draft entries keep the newest ``keep``; the
        dropped entries' draft cache slots join the request's hole (merged with an earlier one:
        one hole per request, so the context between two holes is masked too)."""
        drop = torch.where(st.ext_num >= cap, st.ext_num - keep, torch.zeros_like(st.ext_num))   # [B]
        n, F = st.ext_tokens.shape[1], st.ext_feats.shape[-1]
        idx = (torch.arange(n, device=drop.device)[None, :] + drop[:, None]).clamp(max=n - 1)     # [B, n]
        st.ext_tokens = st.ext_tokens.gather(1, idx)
        st.ext_feats = st.ext_feats.gather(1, idx[:, :, None].expand(-1, -1, F))
        if st.draft_hole is None:
            st.draft_hole = torch.zeros(st.ext_num.shape[0], 2, dtype=torch.int64, device=drop.device)
        lo, hi = st.draft_hole.unbind(1)
        dropping = drop > 0
        lo = torch.where(dropping & (lo == hi), st.draft_lens, lo)
        hi = torch.where(dropping, st.draft_lens + drop, hi)
        st.draft_hole = torch.stack([lo, hi], dim=1)
        st.draft_lens = st.draft_lens + drop
        st.ext_num = st.ext_num - drop

    def _cold_step(self, st: _Batch, root: torch.Tensor, feat: torch.Tensor, stepped: torch.Tensor) -> None:
        """The draft's side of a cold plain step whose new entry sits at ``stepped``: every older
        pending entry joins the hole and the new one is all that is pending. After a cold step
        whose tensors are still the batch's (:attr:`_Batch.cold_tail`: nothing drafted,
        appended or compacted since) the hole already ends at the entry that step added, and
        only its end moves. Few ops, because each costs 10-20 us here: right after a forward
        has streamed the weights through them, the CPU's caches hold none of the dispatcher's
        state (a plain step's draft bookkeeping took ~0.2 ms at batch 4, 1.2 % of the step,
        on the 2-core box: bench/RESULTS.md, fifty-third session)."""
        tail = st.cold_tail
        if (tail is not None and tail[0] is st.ext_tokens and tail[1] is st.draft_hole
                and tail[2] is st.draft_lens and tail[3] is st.ext_num):
            st.draft_hole[:, 1] = stepped       # (the hole a cold step made: only this batch holds it)
        else:
            self._forget_all_pending(st, stepped)
            st.ext_num = torch.ones_like(st.ext_num)
        st.draft_lens = stepped
        fresh = feat[:, None]
        st.ext_tokens = root[:, None]
        st.ext_feats = fresh if fresh.dtype == st.ext_feats.dtype else fresh.to(st.ext_feats.dtype)
        st.cold_tail = (st.ext_tokens, st.draft_hole, st.draft_lens, st.ext_num)

    @staticmethod
    def _forget_all_pending(st: _Batch, upto: torch.Tensor) -> None:
        """Every request's pending entries (draft slots ``draft_lens .. upto - 1``) join its hole,
        which then ends at ``upto`` (== draft_lens + ext_num: a cold step adds the entry there)."""
        if st.draft_hole is None:
            st.draft_hole = torch.zeros(st.ext_num.shape[0], 2, dtype=torch.int64, device=upto.device)
        lo, hi = st.draft_hole.unbind(1)
        st.draft_hole = torch.stack([torch.where(lo == hi, st.draft_lens, lo), upto], dim=1)
        st.draft_lens = upto

    @staticmethod
    def _catchup_tokens(st: _Batch, active: List[int]) -> float:
        """The tokens per running request the draft extends over before its next tree: its
        pending entries, and the prompt where the call deferred the draft's prompt pass. (One
        host read each, summed in Python: indexing, casting and averaging on the tensor were
        four ops of ~10 us each, every speculative round.)"""
        num = st.ext_num.tolist()
        mean = sum(num[b] for b in active) / len(active)
        if st.deferred is not None:
            prompt = st.deferred[2].tolist()
            mean += sum(prompt[b] for b in active) / len(active)
        return float(mean)

    def _compaction_pays(self, rows: int, running: int, left: int) -> bool:
        """Whether a batch of ``rows`` rows with ``running`` requests still running, the slowest
        ``left`` tokens from its end, drops its finished requests' rows now. The copy of both
        caches costs about one step of the whole batch; each later step of the running requests
        alone saves the cost model's difference between the two plain steps, for at most
        ``left`` steps. (A finished row rides along in every forward, and while one does no
        round is timed: in a static batch's tail the guard saw nothing, and a bucket whose model
        predicted a gain speculated there, losing, every call; bench/RESULTS.md, fifty-third
        session.) Without a cost model loaded: once the batch falls to a smaller batch bucket."""
        if running >= rows or left < COMPACT_MIN_LEFT:
            return False
        from .costmodel import CostModel
        cm = self._cost_model if isinstance(self._cost_model, CostModel) else None
        if cm is None:
            return FittedPolicy.bucket(running) < FittedPolicy.bucket(rows)
        whole = cm.plain_ms(rows)
        return (whole - cm.plain_ms(running)) * left >= whole

    def _graph_one_offs(self) -> int:
        return self.round_graphs.one_offs() if self.round_graphs is not None else 0

    def _round_seconds(self, t0: float, one_offs: int, riding: bool = False) -> Optional[float]:
        """The wall time of a round or plain step since ``t0`` for the policy's time corrections,
        or None when it ran a configuration's first eager run or captured a CUDA graph: one-off
        costs a 3x slower "round" would teach the policy (on an H200 the first rounds' captures
        made the fitted policy stop speculating for the whole run). None too while finished
        requests' rows rode along in the forwards (``riding``; a static batch's last tokens): the
        plan is priced at the requests running, and a batch-8 forward timed as a batch-1 round
        taught the batch-1 bucket a speculative time 2.3x the model's, which kept later batch-1
        calls plain (bench/RESULTS.md, forty-fifth session)."""
        if self._graph_one_offs() != one_offs or riding:
            return None
        return time.perf_counter() - t0

    def _bind_graph_storage(self, graphs: RoundGraphs, st: _Batch) -> None:
        """Tell the graphs which caches this batch updates; when that drops them (new caches),
        the draft's tree buffers kept for them may go too (until then the draft keeps one set
        per shape: captured rounds go on using theirs)."""
        if self.draft is not None:
            self.draft.keep_tree_pools = True
        if graphs.bind_storage(st.target_cache.k, st.draft_cache.k if st.draft_cache is not None else None) \
                and self.draft is not None:
            self.draft.release_tree_pools()

    def _target_graphs(self, st: _Batch, T: int):
        """``(graphs, attn)`` for a target forward of ``T`` rows per request replayed from CUDA
        graphs, or ``(None, None)`` when it runs eagerly (no graphs, or a backend that cannot be
        captured as it is). A FlashInfer target (whose custom-mask plan depends on the tree and
        cannot be captured) attends with SDPA in replays (``graph_attention == "sdpa"``), or in
        two passes (SplitTreeAttention, ``"split"``) whose prefix pass is planned here, on the
        host, before every replay."""
        graphs = self.round_graphs if self.static_rounds else None
        if graphs is None:
            return None, None
        attn = self._split_attention(st.size)
        if attn is None:
            if self.target.backend.name == "sdpa":
                return graphs, None
            if self.graph_attention != "sdpa":
                return None, None
            if self._graph_sdpa is None:
                from .models.attention import SdpaAttention
                self._graph_sdpa = SdpaAttention()
            return graphs, self._graph_sdpa
        c = self.target.config
        attn.host_plan(st.host_lens, T, c.num_heads, st.target_cache, c.head_dim ** -0.5)
        return graphs, attn

    def _plain_step(self, st: _Batch, params: SamplingParams, drafting: bool):
        """The target forward of one plain step and the token it picks -> ``(root [B], feature
        [B, F] or None)``; with CUDA graphs replayed per (batch, sampling, drafting): an eager
        one-token step of a GPU is launch-bound (an 8B-shaped one took 24 ms eagerly and 7.4 ms
        replayed on an H200), and it is both autoregressive decoding and HeteroSpec's plain rounds."""
        taps = self._taps if drafting else None
        tcache = st.target_cache

        def step(root, prefix_lens, keys=None, attn=None):
            logits, feats = self.target(root[:, None], prefix_lens[:, None], tcache, prefix_lens, None, None,
                                        return_features=drafting, taps=taps, attn=attn)
            # the root sits at prefix_lens: its logits draw the token at prefix_lens + 1
            return [self._pick(logits[:, 0], params, keys, prefix_lens + 1), feats[:, 0] if drafting else None]

        graphs, attn = self._target_graphs(st, 1)
        if graphs is None:
            return tuple(step(st.root, st.prefix_lens, st.sample_keys))
        self._bind_graph_storage(graphs, st)
        # Sampling draws nothing from a generator: the keys are an input like the lengths, so one
        # graph serves every call with these sampling settings.
        key = ("plain", drafting, params.greedy, params.temperature, params.top_p, params.top_k, id(attn))
        inputs = [st.root, st.prefix_lens] + ([] if params.greedy else [st.sample_keys])
        out = graphs.run(key, lambda root, lens, keys=None: step(root, lens, keys, attn), inputs, keep=(attn,))
        return out[0], out[1]

    # -- context lookup (heterospec.lookup) --------------------------------------------------------
    def _lookup_choice(self, st: _Batch, index: List[ContextIndex], ids: List[List[int]],
                       history: Optional[OutputHistory], keys: Optional[List[int]],
                       corpus: Optional[CorpusIndex], pol: FittedPolicy,
                       gate: LookupGate, context: int, max_new_tokens: int) -> Optional[LookupRound]:
        """The gate's lookup round for the running requests, or None (the policy's plan runs):
        asked every round, or every 2nd / 4th where its choices at this batch size keep
        declining (:meth:`LookupGate.due`)."""
        active = st.active()
        bucket = FittedPolicy.bucket(len(active))
        if not gate.due(bucket):
            return None
        chosen = self._lookup_proposals(st, index, ids, history, keys, corpus, pol, gate, context, max_new_tokens)
        gate.answered(bucket, chosen is not None)
        return chosen

    def _lookup_proposals(self, st: _Batch, index: List[ContextIndex], ids: List[List[int]],
                          history: Optional[OutputHistory], keys: Optional[List[int]],
                          corpus: Optional[CorpusIndex], pol: FittedPolicy,
                          gate: LookupGate, context: int, max_new_tokens: int) -> Optional[LookupRound]:
        """The requests' proposals and the gate's choice. A static batch ends with its slowest
        request, so the gate weighs how far a round moves the slowest one (``lead``,
        :meth:`LookupGate.choose`); only requests less than ``kmax`` tokens ahead of it can
        bound that, and only they are proposed for (a request's index takes up the tokens it
        emitted since it was last asked)."""
        active = st.active()
        least = min(len(st.outputs[b]) for b in active)
        proposals, room, lead = [([], 0)] * st.size, [0] * st.size, [0] * st.size
        for b in active:
            room[b], lead[b] = max_new_tokens - len(st.outputs[b]), len(st.outputs[b]) - least
        for b in sorted(active, key=lead.__getitem__):       # the slowest requests first
            if lead[b] >= gate.kmax:
                break
            out, row = st.outputs[b], st.rows[b]
            idx = index[row]
            idx.extend(out[len(idx) - len(ids[row]):])
            proposals[b] = gate.propose(idx, gate.kmax, history, keys[row] if keys is not None else None, corpus)
            if gate.holds_batch(proposals[b], lead[b], room[b]):
                return None     # (the others' proposals could not change that)
        if not any(p[0] for p in proposals):
            return None
        B, c = len(active), FittedPolicy.context_bucket(context)
        costs, bucket = pol.costs, FittedPolicy.bucket(B)

        def alternative() -> float:
            """The rate of what runs instead: a plain step as the gate measured plain steps
            against the same cost model, or the speculative plan's prediction (which carries the
            policy's own measured time scale); a plan without a prediction: 0."""
            plan = pol.plan(B, context)
            if not plan.speculate:
                return 1e3 * B / (costs.plain_ms(B, c) * gate.time_scale(bucket, "plain"))
            return ((plan.expected or {}).get("speculative") or {}).get("tokens_per_s", 0.0)

        ragged = self.ragged_verify and B > 1
        return gate.choose(proposals, lambda mean, most: costs.verify_ms(B, mean if ragged else most, c),
                           alternative, room, bucket, lead)

    def _lookup_tree(self, st: _Batch, chosen: LookupRound) -> _Tree:
        """Each request's copied chain as a tree: candidate j's parent is j - 1, scores fall along
        the chain (so the verified set is its first ``budget`` tokens); no entropy, no bin."""
        B, dev = st.size, self.device
        lens = [len(c) for c in chosen.chains]
        C = max(max(lens), 1)
        # built as lists, one tensor each (a lookup round's Python is most of its host time)
        tokens = torch.tensor([list(c) + [0] * (C - n) for c, n in zip(chosen.chains, lens)], dtype=torch.int64)
        budget = torch.tensor(lens, dtype=torch.int64)
        ninf = float("-inf")
        scores = torch.tensor([[-(j + 1.0) if j < n else ninf for j in range(C)] for n in lens])
        parents = torch.arange(-1, C - 1).expand(B, C).contiguous()
        zeros = torch.zeros(B, dtype=torch.int64, device=dev)
        return _Tree(scores=scores.to(dev), parents=parents.to(dev), tokens=tokens.to(dev),
                     local=torch.zeros(B, C, device=dev), budget=budget.to(dev), depth=budget.to(dev),
                     entropy=torch.zeros(B, device=dev), bins=zeros - 1, pstar=zeros - 1)

    # -- one round's two halves: eagerly, or replayed as CUDA graphs --------------------------------
    def _draft_half(self, st: _Batch, cfg: SpecConfig, plan: Plan) -> _Tree:
        """The draft half of a round (:meth:`_draft_tree`); with CUDA graphs, replayed per
        configuration. The pending extend is padded to a multiple of ``_EXTEND_BUCKET`` columns so
        that a few plain steps between rounds do not need graphs of their own. A plan whose bins
        act differently runs as two graphs (:meth:`_split_rounds`)."""
        graphs = self.round_graphs if self.static_rounds else None
        split = self.static_rounds and self._split_rounds(plan)
        if graphs is None:
            if not split:
                return self._draft_tree(st, cfg, plan)
            d = self._draft_decide(st, cfg, plan, depth_cap=self._envelope(plan))   # as replayed split rounds run
            depth, nodes = self._split_shape(st, plan, d.depth_limit, d.budget)
            tree = self._draft_deeper(d, st, cfg, plan, depth)
            tree.verify_nodes = nodes
            return tree
        self._bind_graph_storage(graphs, st)
        B, n, F = st.ext_feats.shape
        W = -(-n // _EXTEND_BUCKET) * _EXTEND_BUCKET
        env = self._envelope(plan) if split else None
        tcache, dcache = st.target_cache, st.draft_cache
        plan.prepare(self.device)

        def draft(ext_tokens, ext_feats, ext_num, draft_lens, prefix_lens, root, draft_hole, *plan_tensors):
            half = _Batch(prefix_lens=prefix_lens, root=root, target_cache=tcache, draft_cache=dcache,
                          draft_lens=draft_lens, ext_tokens=ext_tokens, ext_feats=ext_feats, ext_num=ext_num,
                          draft_hole=draft_hole)
            view = plan.with_tensors(plan_tensors)
            if split:
                return _drafting_tensors(self._draft_decide(half, cfg, view, depth_cap=env)) + [half.draft_lens]
            tree = self._draft_tree(half, cfg, view)
            return [getattr(tree, f) for f in _TREE_TENSORS] + [half.draft_lens]

        # The plan's edges, depths and budgets are inputs (copied before each replay): plans that
        # differ only in them (the fitted policy's online corrections move them) share a graph.
        inputs = [st.ext_tokens, st.ext_feats, st.ext_num, st.draft_lens, st.prefix_lens, st.root, st.draft_hole,
                  *plan.tensors()]
        key = ("decide", _split_key(plan, env)) if split else ("draft", _plan_key(plan))
        out = graphs.run((*key, cfg.top_k, cfg.pstar_pool), draft, inputs, shapes=[(B, W), (B, W, F)] + [None] * 8)
        st.draft_lens = out[-1]
        if not split:
            return _Tree(**dict(zip(_TREE_TENSORS, out[:-1])))

        drafting = out[:-1]
        depth, nodes = self._split_shape(st, plan, drafting[-4], drafting[-3])
        k, cap, n_done = cfg.top_k, max(env, 1) * cfg.top_k, plan.decide_depth * cfg.top_k
        ek, keys = _entropy_keys(plan, k)

        def deeper(*args):
            *d_args, prefix_lens, draft_hole = args[:len(drafting) + 2]
            d = _drafting_from(d_args, keys, ek)
            d.state = self.draft.new_tree(B, capacity=cap)
            self.draft.resume_tree(d.state, dcache, n_done, d.f_hidden)
            half = _Batch(prefix_lens=prefix_lens, root=None, target_cache=tcache, draft_cache=dcache,
                          draft_hole=draft_hole)
            tree = self._draft_deeper(d, half, cfg, plan.with_tensors(args[len(drafting) + 2:]), depth)
            return [getattr(tree, f) for f in _TREE_TENSORS]

        out = graphs.run(("deeper", _split_key(plan, env), depth, cfg.top_k, cfg.pstar_pool), deeper,
                         [*drafting, st.prefix_lens, st.draft_hole, *plan.tensors()])
        tree = _Tree(**dict(zip(_TREE_TENSORS, out)))
        tree.verify_nodes = nodes
        return tree

    def _envelope(self, plan: Plan) -> int:
        """The tree depth split rounds size their buffers for (:attr:`_split_depth`), grown to
        ``plan``'s deepest bin when it drafts deeper."""
        self._split_depth = max(self._split_depth, plan.max_depth)
        return self._split_depth

    def _split_shape(self, st: _Batch, plan: Plan, depth_limit: torch.Tensor, budget: torch.Tensor):
        """A split round's second host read: the forwards of the batch's deepest bin and the
        draft nodes of its largest budget (finished requests verify the root only)."""
        done = st.done_mask(self.device)
        depth, nodes = (int(x) for x in torch.stack([
            torch.where(done, torch.zeros_like(depth_limit), depth_limit).max(),
            torch.where(done, torch.zeros_like(budget), budget).max()]).tolist())
        return max(depth, plan.decide_depth), nodes

    def _split_rounds(self, plan: Plan) -> bool:
        """Whether replayed rounds of ``plan`` split at the decision (:attr:`bin_graphs`): its
        bins draft or verify differently, and the draft keeps its tree in the static layout
        (whose buffers the two graphs share)."""
        if not self.bin_graphs or plan.num_bins < 2 or (len(set(plan.depth)) < 2 and len(set(plan.budget)) < 2):
            return False
        kf = self.draft.kernel_friendly_attention
        return self.device.type == "cuda" if kf is None else bool(kf)

    def _verify_half(self, st: _Batch, tree: _Tree, plan: Plan, params: SamplingParams) -> "_Verdict":
        """The verification half of a round (:meth:`_verify`); with CUDA graphs, replayed per
        configuration (the target forward's attention: :meth:`_target_graphs`)."""
        done = st.done_mask(self.device)
        nodes = plan.max_nodes if tree.verify_nodes is None else tree.verify_nodes
        # Static rounds: the next extend holds the accepted path, root + at most depth + 1
        # layers, not the verified tree's width (that made the next draft graph's width follow
        # the budget: a graph per budget, 96 columns of extend for 9 tokens).
        path_cap = (plan.max_depth if tree.verify_nodes is None else self._split_depth) + 2 \
            if self.static_rounds else None
        graphs, attn = self._target_graphs(st, nodes + 1)
        if graphs is None:
            return self._verify(st, tree, plan, params, done, max_nodes=nodes, path_cap=path_cap)
        tcache = st.target_cache
        n_tree = len(_TREE_TENSORS)

        def verify(*args):
            tree_args, (root, prefix_lens, done_), keys = args[:n_tree], args[n_tree:n_tree + 3], args[n_tree + 3:]
            half = _Batch(prefix_lens=prefix_lens, root=root, target_cache=tcache, sample_keys=keys[0] if keys else None)
            v = self._verify(half, _Tree(**dict(zip(_TREE_TENSORS, tree_args))), plan, params, done_, attn,
                             max_nodes=nodes, path_cap=path_cap)
            return ([getattr(v, f) for f in _VERDICT_TENSORS] +
                    [half.ext_tokens, half.ext_feats, half.ext_num, half.draft_lens])

        # Nothing is drawn from a generator (a sampling round's keys are an input): the graphs of
        # a configuration serve every call.
        key = ("verify", nodes, path_cap, params.greedy, params.temperature, params.top_p, params.top_k, id(attn))
        inputs = [getattr(tree, f) for f in _TREE_TENSORS] + [st.root, st.prefix_lens, done]
        out = graphs.run(key, verify, inputs + ([] if params.greedy else [st.sample_keys]), keep=(plan, attn))
        nv = len(_VERDICT_TENSORS)
        st.ext_tokens, st.ext_feats, st.ext_num, st.draft_lens = out[nv:]
        return _Verdict(**dict(zip(_VERDICT_TENSORS, out[:nv])))

    def _split_attention(self, batch_size: int):
        """The split attention of replayed target forwards (a FlashInfer target with
        ``graph_attention == "split"``, or a factory set by tests), one per batch size; None
        otherwise (see :meth:`_target_graphs`)."""
        if self.graph_attention not in ("sdpa", "split"):
            raise ValueError(f"Engine.graph_attention must be 'sdpa' or 'split', got {self.graph_attention!r}")
        factory = self.split_attention_factory
        if factory is None and self.target.backend.name == "flashinfer" and self.graph_attention == "split":
            factory = self._flashinfer_split   # not kept as the factory: graph_attention may change back
        if factory is None:
            return None
        if batch_size not in self._split:
            self._split[batch_size] = factory(batch_size)
        return self._split[batch_size]

    def _flashinfer_split(self, batch_size: int):
        from .models.attention import FlashInferPrefixPass, SplitTreeAttention
        return SplitTreeAttention(FlashInferPrefixPass(self.device, batch_size))

    # -- draft ------------------------------------------------------------------------------------
    def _draft_tree(self, st: _Batch, cfg: SpecConfig, plan: Plan, trace_ks: Sequence[int] = ()) -> _Tree:
        """Draft one tree per request. ``plan`` says after how many forwards ``H(P*)`` is read
        (``decide_depth``), with which K, and each bin's depth and budget. ``trace_ks``
        (calibration only): also keep every candidate's path entropy for these K."""
        d = self._draft_decide(st, cfg, plan, trace_ks)
        return self._draft_deeper(d, st, cfg, plan, plan.max_depth)

    def _draft_decide(self, st: _Batch, cfg: SpecConfig, plan: Plan, trace_ks: Sequence[int] = (),
                      depth_cap: int = 0) -> "_Drafting":
        """A round's drafting up to HeteroSpec's decision: the extend over last round's tokens,
        the root's children, ``decide_depth`` draft forwards, and the bin of each request (its
        depth and budget). :meth:`_draft_deeper` goes on from there. ``depth_cap``: size the
        tree's buffers for this depth when deeper than the plan's (split rounds' envelope)."""
        draft, B, k, dev = self.draft, st.size, cfg.top_k, self.device
        ek, keys = _entropy_keys(plan, k, trace_ks)
        rows = torch.arange(B, device=dev)

        # 1. Extend the draft over the tokens committed last round; its last output is the root's.
        if st.deferred is not None:       # the prompt first (slots 0 .., before any hole)
            tokens, feats, num = st.deferred
            t0 = timestamp(dev)
            draft.extend(tokens, feats, st.draft_cache, torch.zeros_like(num), num)
            st.prompt_pass_s = timestamp(dev) - t0
            st.deferred = None
        n = st.ext_tokens.shape[1] if self.static_rounds else int(st.ext_num.max())
        hidden = draft.extend(st.ext_tokens[:, :n], st.ext_feats[:, :n], st.draft_cache, st.draft_lens,
                              st.ext_num, st.draft_hole)
        st.draft_lens = st.draft_lens + st.ext_num                              # == st.prefix_lens
        h_root = hidden[rows, st.ext_num - 1]                                    # [B, H]
        lp_full, ids, ent = ops.topk_entropy(draft.logits(h_root), ek, None)
        lp, ids = lp_full[:, :k], ids[:, :k]                                     # [B, k]

        decide_depth, max_depth = plan.decide_depth, plan.max_depth
        cap_depth = max(max_depth, depth_cap)
        C = k + cap_depth * k * k
        d = _Drafting(scores=torch.full((B, C), float("-inf"), device=dev),
                      parents=torch.full((B, C), -1, dtype=torch.int64, device=dev),
                      tokens=torch.zeros((B, C), dtype=torch.int64, device=dev),
                      local=torch.full((B, C), float("-inf"), device=dev),
                      ent_k={}, ek=ek, traced=bool(trace_ks),
                      frontier=torch.arange(k, device=dev).expand(B, k),                  # candidate ids
                      f_hidden=h_root[:, None, :].expand(B, k, h_root.shape[-1]),         # parent outputs
                      f_slot=torch.full((B, k), -1, dtype=torch.int64, device=dev),       # parents' tree slots
                      depth_limit=torch.full((B,), max(decide_depth, max_depth), dtype=torch.int64, device=dev),
                      budget=torch.full((B,), plan.max_nodes, dtype=torch.int64, device=dev),
                      bins=torch.full((B,), -1, dtype=torch.int64, device=dev),
                      pstar=torch.zeros(B, dtype=torch.int64, device=dev),
                      # Static rounds: the draft's tree buffers hold the deepest plan from the start.
                      state=draft.new_tree(B, capacity=max(cap_depth, 1) * k) if self.static_rounds
                      else draft.new_tree(B))
        # H(P*) uses K = plan.entropy_k; the top-ek pass may be wider (traces, a larger tree top_k).
        # ent_k[ek] (d.entropy) is the op's own path entropy of each candidate's path; other K
        # are derived from the same top-ek pass.
        for K in keys:
            d.ent_k[K] = torch.zeros((B, C), device=dev)

        # Layer 1: children of the root.
        d.scores[:, :k], d.tokens[:, :k], d.local[:, :k] = lp, draft.to_target_ids(ids), lp
        d.entropy[:, :k] = ent[:, None]
        for K in d.ks:
            d.ent_k[K][:, :k] = _topk_entropy_of(lp_full, K, torch.zeros_like(ent))[:, None]
        if decide_depth == 0:   # decide on layer 1, the root's children
            self._decide(d, cfg, plan, 0, first_layer=True)
        self._draft_steps(d, st, cfg, 1, decide_depth, plan)
        return d

    def _draft_deeper(self, d: "_Drafting", st: _Batch, cfg: SpecConfig, plan: Plan, depth: int) -> _Tree:
        """Draft forwards after the decision up to ``depth`` (requests whose bin drafts fewer stop
        earlier: their candidates are -inf), and the round's tree."""
        self._draft_steps(d, st, cfg, plan.decide_depth + 1, depth, plan)
        pstar_entropy = d.ent_k[plan.entropy_k].gather(1, d.pstar[:, None])[:, 0]
        return _Tree(d.scores, d.parents, d.tokens, d.local, d.budget, depth=d.depth_limit + 1, entropy=pstar_entropy,
                     bins=d.bins if plan.num_bins > 1 else torch.full_like(d.bins, -1), pstar=d.pstar,
                     path_entropy=d.ent_k if d.traced else None)

    def _decide(self, d: "_Drafting", cfg: SpecConfig, plan: Plan, base: int, first_layer: bool = False) -> None:
        """HeteroSpec: P*'s path entropy picks each request's bin, and the bin its depth
        (extended drafting) and budget (Top-N pruning)."""
        d.pstar = self._pstar(d.scores, d.local, base, cfg.top_k, cfg, first_layer=first_layer)
        d.bins, d.depth_limit, d.budget = plan.decide(
            d.ent_k[plan.entropy_k].gather(1, d.pstar[:, None])[:, 0].contiguous())

    def _draft_steps(self, d: "_Drafting", st: _Batch, cfg: SpecConfig, first: int, last: int, plan: Plan) -> None:
        """Draft forwards ``first..last`` (depths) over the frontier, ``k`` children per node,
        deciding the bins after forward ``plan.decide_depth``."""
        draft, B, k = self.draft, st.size, cfg.top_k
        for step in range(first, last + 1):
            if step > plan.decide_depth and not self.static_rounds and not bool(d.drafts_at(step).any()):
                break
            # 2. One draft forward over the frontier (depth `step`), k children per node.
            positions = (st.prefix_lens + step - 1)[:, None].expand(B, k)
            f_tokens = d.tokens.gather(1, d.frontier)
            out = draft.tree_step(f_tokens, d.f_hidden, d.f_slot, positions, st.draft_cache, st.prefix_lens, d.state,
                                  st.draft_hole)
            lp_full, ids, ent = ops.topk_entropy(
                draft.logits(out).reshape(B * k, -1), d.ek, d.entropy.gather(1, d.frontier).reshape(-1))
            lp, ids = lp_full[:, :k].reshape(B, k, k), ids[:, :k].reshape(B, k, k)
            child_scores = d.scores.gather(1, d.frontier)[:, :, None] + lp              # [B, k, k]
            live = d.drafts_at(step)[:, None, None]
            child_scores = torch.where(live, child_scores, torch.full_like(child_scores, float("-inf")))

            base = k + (step - 1) * k * k
            sl = slice(base, base + k * k)
            d.scores[:, sl] = child_scores.reshape(B, k * k)
            d.parents[:, sl] = d.frontier[:, :, None].expand(B, k, k).reshape(B, k * k)
            d.tokens[:, sl] = draft.to_target_ids(ids).reshape(B, k * k)
            d.local[:, sl] = lp.reshape(B, k * k)
            d.entropy[:, sl] = ent.reshape(B, k, 1).expand(B, k, k).reshape(B, k * k)
            for K in d.ks:
                parent_ent = d.ent_k[K].gather(1, d.frontier).reshape(-1)
                d.ent_k[K][:, sl] = _topk_entropy_of(lp_full, K, parent_ent).reshape(B, k, 1).expand(
                    B, k, k).reshape(B, k * k)

            # 3. HeteroSpec: after decide_depth forwards, P*'s entropy picks the bin, and the bin
            #    its depth (extended drafting) and budget (Top-N pruning).
            if step == plan.decide_depth:
                self._decide(d, cfg, plan, base)
            # 4. Requests whose next layers could not enter their Top-N stop drafting.
            if plan.decide_depth <= step < plan.max_depth and self.stop_dead_layers and not self.static_rounds \
                    and not d.traced:
                self._stop_dead_layers(d, plan.max_nodes, base + k * k, child_scores, step)

            # Next frontier: the k best children by cumulative score (ties: lower index).
            order = torch.sort(child_scores.reshape(B, k * k), dim=1, descending=True, stable=True).indices[:, :k]
            d.frontier = base + order
            d.f_hidden = out.gather(1, (order // k)[:, :, None].expand(B, k, out.shape[-1]))
            d.f_slot = ((step - 1) * k + order // k)

    @staticmethod
    def _stop_dead_layers(d: "_Drafting", max_nodes: int, filled: int, child_scores: torch.Tensor, step: int) -> None:
        """Top-N pruning verifies each request's ``budget`` candidates of highest cumulative score,
        and a score only falls along a path (each draft log-probability is <= 0). So once every
        candidate of the layer just drafted scores below the ``budget``-th best candidate drafted
        so far, no deeper candidate can be selected: the request's depth ends here. Strictly
        below: a tie keeps drafting (``select_tree_nodes`` breaks ties by index). The verified
        tree is exactly the one the bin's full depth would give (and the round's record keeps the
        bin's depth); the saved forwards are the rounds where a flat distribution keeps the best
        candidates shallow. ``filled``: the candidates drafted so far; a request whose budget
        exceeds them drafts on."""
        B, n = child_scores.shape[0], min(max_nodes, filled)    # the largest budget with a budget-th candidate
        if n <= 0:
            return
        best = d.scores[:, :filled].topk(n, dim=1).values                        # [B, n], descending
        nth = best.gather(1, (d.budget.clamp(min=1, max=n) - 1)[:, None])[:, 0]   # the budget-th best score
        dead = ((child_scores.reshape(B, -1).amax(dim=1) < nth) & (d.budget <= n)) | (d.budget <= 0)
        # (the record keeps the bin's depth, the action; only the forwards stop)
        prev = d.depth_limit if d.cut is None else d.cut
        d.cut = torch.where(dead, prev.clamp(max=step), prev)

    @staticmethod
    def _pstar(scores, local, base, k, cfg: SpecConfig, first_layer: bool = False) -> torch.Tensor:
        """P*: the deepest-layer candidate with the highest own (local) draft confidence."""
        width = k if first_layer else k * k
        layer_local = local[:, base:base + width]
        if cfg.pstar_pool == "frontier" and not first_layer:
            # Only the k candidates that the frontier selection keeps compete.
            top = torch.sort(scores[:, base:base + width], dim=1, descending=True, stable=True).indices[:, :k]
            masked = torch.full_like(layer_local, float("-inf")).scatter(1, top, layer_local.gather(1, top))
            layer_local = masked
        return base + layer_local.argmax(dim=1)

    # -- verify -----------------------------------------------------------------------------------
    def _verify(self, st: _Batch, tree: _Tree, plan: Optional[Plan], params: SamplingParams,
                done: Optional[torch.Tensor] = None, attn=None, max_nodes: Optional[int] = None,
                path_cap: Optional[int] = None, append_pending: bool = False):
        """Verify ``tree`` with the target and compact its accepted path into the cache. The
        draft's next extend becomes the accepted path (the draft drafted from everything before
        it), or with ``append_pending`` (a tree it did not draft: context lookup) joins the
        entries it has not yet caught up on; without a draft in use, none is kept."""
        B, dev = st.size, self.device
        budget = tree.budget.clone()
        if done is None:
            done = st.done_mask(dev)
        budget = torch.where(done, torch.zeros_like(budget), budget)   # finished requests: root only
        max_nodes = plan.max_nodes if max_nodes is None else max_nodes   # static rounds: the tree's capacity
        tree_cand, tree_parents, num_nodes = ops.select_tree_nodes(tree.scores, tree.parents, budget, max_nodes)
        # Verify only as many positions as the largest tree in the batch: padding rows cost a
        # full target forward each, and Top-N pruning is worth nothing if they are computed.
        T = max_nodes + 1 if self.static_rounds else int(num_nodes.max())
        tree_cand, tree_parents = tree_cand[:, :T].contiguous(), tree_parents[:, :T].contiguous()
        cand_tokens = tree.tokens.gather(1, tree_cand.clamp(min=0))
        tree_tokens = torch.where(tree_cand >= 0, cand_tokens, st.root[:, None])      # root at position 0
        tree_mask, positions, first_child, next_sibling = ops.build_tree(
            tree_parents, num_nodes, st.prefix_lens)
        keep = not append_pending or st.ext_tokens is not None     # the draft's features wanted
        logits, feats = self.target(tree_tokens, positions, st.target_cache, st.prefix_lens, tree_mask,
                                    num_nodes, return_features=keep, taps=self._taps if keep else None,
                                    ragged=self.ragged_verify and not self.static_rounds, attn=attn)
        # The target's token at every node: its argmax (greedy), or its draw with the keyed uniform
        # of the position the node's row predicts (sampling.py: the same draw a plain step makes
        # there, so the walk below emits exactly the target's sample). A draft token is accepted
        # where it equals the target's token; the bonus is the target's token after the path.
        invalid = None
        if params.greedy:
            top1 = greedy_tokens(logits)
        else:
            top1, ok = draw_rows(logits, params, position_uniforms(st.sample_keys, positions + 1))
        accept_path, accept_len, bonus = ops.verify_greedy(tree_tokens, top1, first_child, next_sibling, num_nodes)
        if not params.greedy:
            # A row that is not a distribution (non-finite logits) matters where the walk read it:
            # the first such position on the path, raised in _commit's host read (no sync here).
            on_path = torch.arange(accept_path.shape[1], device=dev)[None, :] <= accept_len[:, None]
            bad = on_path & ~ok.gather(1, accept_path.clamp(min=0))
            invalid = torch.where(bad.any(1), accept_path.gather(1, bad.to(torch.int64).argmax(1, keepdim=True))[:, 0],
                                  torch.full_like(accept_len, -1))
        st.target_cache.compact(accept_path, accept_len, st.prefix_lens)
        if keep:
            # Next extend: the draft sees root + accepted nodes with their target features, each
            # paired with the token that follows it (the next accepted node, or the bonus).
            path = accept_path[:, :path_cap].clamp(min=0)     # path_cap: the longest path (static rounds)
            path_tokens = tree_tokens.gather(1, path)
            ext_tokens = torch.cat([path_tokens[:, 1:], path_tokens[:, :1]], dim=1)
            ext_tokens.scatter_(1, accept_len[:, None], bonus[:, None])
            ext_feats = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1]))
            if append_pending:
                self._append_pending(st, ext_tokens, ext_feats, accept_len + 1)
            else:
                st.ext_tokens, st.ext_feats, st.ext_num = ext_tokens, ext_feats, accept_len + 1
                st.draft_lens = st.prefix_lens.clone()
        return _Verdict(tree_tokens, tree_cand, num_nodes, accept_path, accept_len, bonus, top1, invalid)

    # -- commit -----------------------------------------------------------------------------------
    def _commit(self, st: _Batch, tree: _Tree, v: "_Verdict", max_new_tokens: int, stream,
                draft_s: Union[float, StageTimer], verify_s: float = 0.0, lookup: bool = False) -> None:
        """Emit the round's tokens and record it. ``draft_s``: the draft's seconds, or the round's
        :class:`StageTimer` with "draft" and "verify" marks (read after the host read below)."""
        accept_len, bonus = v.accept_len, v.bonus
        B, T = v.tree_tokens.shape
        # The round's one read of the device: every integer it needs in one copy, every float in
        # another (CUDA sampling errors travel with them and are raised here).
        invalid = v.invalid if v.invalid is not None else torch.full_like(bonus, -1)
        ints = torch.cat([accept_len, bonus, v.num_nodes, tree.depth, tree.bins, tree.pstar, invalid,
                          v.accept_path.reshape(-1), v.tree_tokens.reshape(-1), v.tree_cand.reshape(-1)]).tolist()
        floats = torch.cat([tree.entropy.float(),
                            tree.scores.gather(1, v.tree_cand.clamp(min=0)).reshape(-1)]).tolist()
        if isinstance(draft_s, StageTimer):
            laps = draft_s.laps()
            draft_s, verify_s = laps["draft"], laps["verify"]
        acc, bon, nn, depth, bins, pstar, bad = (ints[i * B:(i + 1) * B] for i in range(7))
        rest = ints[7 * B:]
        paths, toks, cands = ([rest[(j * B + b) * T:(j * B + b + 1) * T] for b in range(B)] for j in range(3))
        entropy, sel_scores = floats[:B], [floats[B + b * T:B + (b + 1) * T] for b in range(B)]
        if any(i >= 0 for i in bad):
            b = next(b for b, i in enumerate(bad) if i >= 0)
            raise ValueError(f"sampling: the target's distribution at a draft-tree node is not valid (NaN, inf or "
                             f"no mass): the target model produced non-finite logits (request {b}, tree position "
                             f"{bad[b]})")
        new = []
        active = set(st.active())
        for b in range(st.size):
            if b not in active:
                new.append([])
                continue
            a = acc[b]
            new.append([toks[b][p] for p in paths[b][1:a + 1]] + [bon[b]])
            ranks = _score_ranks(sel_scores[b][1:nn[b]])                       # rank per tree position-1
            deepest = paths[b][a]
            tcr = ranks[deepest - 1] if a > 0 else nn[b]
            pstar_pos = cands[b].index(pstar[b]) if pstar[b] in cands[b][1:nn[b]] else 0
            pstar_rank = ranks[pstar_pos - 1] if pstar_pos > 0 else 0
            s = st.stats[b]
            s.rounds += 1
            s.target_calls += 1
            s.verified_tokens += nn[b]
            s.draft_s += draft_s
            s.verify_s += verify_s
            s.records.append(RoundRecord(accept_len=a, verified=nn[b], depth=depth[b], entropy=entropy[b],
                                         bin=bins[b], tcr=tcr, pstar_rank=pstar_rank,
                                         pstar_accepted=pstar_pos > 0 and pstar_pos in paths[b][1:a + 1],
                                         draft_s=draft_s, verify_s=verify_s, lookup=lookup))
        running = torch.tensor([b in active for b in range(st.size)], device=self.device)
        st.prefix_lens = st.prefix_lens + torch.where(running, accept_len + 1, torch.zeros_like(accept_len))
        st.host_lens = [n + (acc[b] + 1 if b in active else 0) for b, n in enumerate(st.host_lens)]
        st.root = bonus
        self._emit(st, new, max_new_tokens, stream)

    def _emit(self, st: _Batch, new: List[List[int]], max_new_tokens: int, stream) -> None:
        """Append new tokens; stop at the first EOS or at max_new_tokens, never past either."""
        eos = set(self.target.config.eos_token_ids or [])
        called = False
        for b in st.active():
            out = st.outputs[b]
            room = max_new_tokens - len(out)
            chunk = new[b][:max(room, 0)]
            for i, t in enumerate(chunk):
                if t in eos:
                    chunk = chunk[:i + 1]
                    st.finished[b] = "eos"
                    break
            out.extend(chunk)
            if st.finished[b] is None and len(out) >= max_new_tokens:
                st.finished[b] = "length"
            st.all_finished[st.rows[b]] = st.finished[b]
            if stream is not None and chunk:
                stream(st.rows[b], chunk)
                called = True
        if called:
            weights_may_change()     # user code ran: the next forward checks the weights again


def _lookup_state_path(pol) -> Optional[str]:
    """Where the lookup gate's learned state lives beside the fitted policy's online state
    (``*.online-<key>.lookup.json``: cleared with it when the cost model is measured again)."""
    path = getattr(pol, "state_path", None)
    return None if path is None else path.removesuffix(".json") + ".lookup.json"


# Tokens the longest-running request must still have to come before finished requests may be
# dropped from a batch (Engine._compaction_pays weighs the rest).
COMPACT_MIN_LEFT = 16


# CUDA graphs: the pending extend is padded to a multiple of this many columns (a round leaves
# max_nodes + 1 entries, each plain step adds one), and what travels between the two halves.
_EXTEND_BUCKET = 16
# CUDA graphs: KV cache lengths are rounded up to a multiple of this, and a kept cache serves a
# call that leaves at most max(_CACHE_SLACK, the call's own length) of its slots unused, so that
# calls of similar lengths (and the methods' different tree capacities) share one cache and its
# graphs.
_CACHE_BUCKET = 256
_CACHE_SLACK = 1024
_TREE_TENSORS = ("scores", "parents", "tokens", "local", "budget", "depth", "entropy", "bins", "pstar")
_VERDICT_TENSORS = ("tree_tokens", "tree_cand", "num_nodes", "accept_path", "accept_len", "bonus",
                    "target_top1", "invalid")


def _entropy_keys(plan: Plan, k: int, trace_ks: Sequence[int] = ()) -> Tuple[int, List[int]]:
    """``(ek, keys)``: the top-k width of a round's topk_entropy passes (the tree's k, the plan's
    K, trace K, whichever is widest) and the K whose path entropies the round keeps, sorted."""
    ek = max([plan.entropy_k, k, *trace_ks])
    return ek, sorted({plan.entropy_k, *trace_ks, ek})


def _drafting_tensors(d: "_Drafting") -> List[torch.Tensor]:
    """What a split round's decide graph hands its deeper graph (:func:`_drafting_from`); the
    depth limits and budgets are the 4th and 3rd from the end."""
    return ([d.scores, d.parents, d.tokens, d.local] + [d.ent_k[K] for K in sorted(d.ent_k)] +
            [d.frontier, d.f_hidden, d.f_slot, d.depth_limit, d.budget, d.bins, d.pstar])


def _drafting_from(tensors: Sequence[torch.Tensor], keys: Sequence[int], ek: int) -> "_Drafting":
    """The :class:`_Drafting` of :func:`_drafting_tensors` (without its tree state)."""
    t = list(tensors)
    scores, parents, tokens, local = t[:4]
    ent_k = dict(zip(keys, t[4:4 + len(keys)]))
    frontier, f_hidden, f_slot, depth_limit, budget, bins, pstar = t[4 + len(keys):]
    return _Drafting(scores=scores, parents=parents, tokens=tokens, local=local, ent_k=ent_k, ek=ek,
                     frontier=frontier, f_hidden=f_hidden, f_slot=f_slot, depth_limit=depth_limit, budget=budget,
                     bins=bins, pstar=pstar, state=None)


def _plan_key(plan: Plan) -> tuple:
    """Everything of a plan that a captured draft half bakes in (its shapes and loop counts; the
    edges, depths and budgets are the graph's inputs)."""
    return (plan.decide_depth, plan.entropy_k, plan.num_bins, plan.max_depth, plan.max_nodes)


def _split_key(plan: Plan, depth_cap: int) -> tuple:
    """The same for a split round's graphs: the binning option (when the decision is read, with
    which K, how many bins) and the envelope its buffers are sized for. The deepest bin and the
    largest budget are not baked in: the decision writes every row's depth and budget from the
    plan's tensors, and the deeper graph's forwards and the verify graph's nodes are keys of
    their own."""
    return (plan.decide_depth, plan.entropy_k, plan.num_bins, depth_cap)


def _progress(st: _Batch, behind: List[int], before: int) -> float:
    """How far a round moved the batch's slowest running request: the least output length of
    the requests still running after it, less ``before`` (the least before it; ``behind``
    were the requests at ``before``). Summed over a call's rounds this is the slowest request's
    length, so the guard measures the rate at which the static batch ends - a round that moves
    one request of four gives the batch nothing. A round that finished every request: the
    most it gave one of ``behind``."""
    running = st.active()
    if running:
        return min(len(st.outputs[b]) for b in running) - before
    return max(len(st.outputs[b]) for b in behind) - before


def _topk_entropy_of(topk_logprobs: torch.Tensor, K: int, parent: torch.Tensor) -> torch.Tensor:
    """``parent + H`` of the top-``K`` of already sorted top log-probabilities (renormalised),
    as :func:`heterospec.ops.topk_entropy` computes it for ``k = K``."""
    if K == topk_logprobs.shape[-1]:
        q = torch.softmax(topk_logprobs, dim=-1)
    else:
        q = torch.softmax(topk_logprobs[..., :K], dim=-1)
    h = -(q * torch.log(q.clamp_min(1e-38))).sum(-1)
    return parent + h


_WARNED = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, stacklevel=3)


def _score_ranks(scores: List[float]) -> List[int]:
    """1-based rank of each score among ``scores`` (higher first, ties by position)."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    ranks = [0] * len(scores)
    for r, i in enumerate(order):
        ranks[i] = r + 1
    return ranks
