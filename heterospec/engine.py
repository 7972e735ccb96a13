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
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Union

import torch

from . import ops
from .config import SamplingParams, SpecConfig, _as_int, default_config
from .entropy import BinPolicy, EntropyBins
from .sampling import make_generator, processed_probs, sample

METHODS = ("heterospec", "eagle3", "autoregressive")

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
                                            "verified_tokens", "prefill_s", "draft_s", "verify_s", "total_s")}
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
    outputs: List[List[int]] = field(default_factory=list)
    finished: List[Optional[str]] = field(default_factory=list)
    stats: List[GenerationStats] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.root.shape[0]

    def active(self) -> List[int]:
        return [b for b, f in enumerate(self.finished) if f is None]


@dataclass
class _Verdict:
    """The verified tree and what the target accepted of it."""

    tree_tokens: torch.Tensor   # [B, T] token at each tree position (root at 0)
    tree_cand: torch.Tensor     # [B, T] candidate index of each position (-1: root / padding)
    num_nodes: torch.Tensor     # [B] real positions, root included
    accept_path: torch.Tensor   # [B, T] positions of root + accepted nodes, -1 padded
    accept_len: torch.Tensor    # [B] accepted draft nodes
    bonus: torch.Tensor         # [B] the target's token after the last accepted node


@dataclass
class _Tree:
    """A drafted candidate set and what HeteroSpec decided about it (all ``[B, ...]``)."""

    scores: torch.Tensor      # [B, C] cumulative log-scores, -inf = not drafted
    parents: torch.Tensor     # [B, C] parent candidate index, -1 = root
    tokens: torch.Tensor      # [B, C] target-vocabulary ids
    local: torch.Tensor       # [B, C] the candidate's own draft log-prob
    budget: torch.Tensor      # [B] draft nodes to verify
    depth: List[int]          # candidate layers drafted per request
    entropy: List[float]      # H(P*) per request
    bins: List[int]           # entropy bin per request (-1 when not binned)
    pstar: List[int]          # candidate index of P*'s final node per request


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 on this (Linux) CPU: bf16 matmuls run natively, not emulated."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_draft_dtype(device, target_dtype: torch.dtype) -> torch.dtype:
    """The draft's dtype for a target on ``device`` in ``target_dtype``.

    The draft only proposes; what is accepted is decided by the target alone, so the draft's
    precision can never change the output (greedy or sampled), only tau. On a CPU with native
    bf16 a float32 target gets a bfloat16 draft: measured on the 2-core dev box (SmolLM2 pair,
    tree (4, 3, 8)) the draft's time per round halves (26.9 -> 14.3 ms) at the same tau (2.31 vs
    2.30), about 6 % more tokens/s. Elsewhere the draft follows the target."""
    kind = getattr(device, "type", str(device)).split(":")[0]
    if kind == "cpu" and target_dtype == torch.float32 and cpu_has_native_bf16():
        return torch.bfloat16
    return target_dtype


# ---------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------
_DRAFT_METHODS = ("new_cache", "extend", "tree_step")
_PROMPT_KINDS = "a prompt must be a string, a list or tuple of token ids, or a 1-D integer tensor"
_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}


def _is_int(x) -> bool:
    """An integer token id or count (numpy integers included), not a bool or a float."""
    return not isinstance(x, bool) and hasattr(x, "__index__")


def _float_dtype(name: str, dtype):
    """None, a floating torch dtype, or its name ("bfloat16"); anything else is an error."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in _DTYPE_NAMES:
            raise ValueError(f"{name} must be one of {', '.join(_DTYPE_NAMES)}, got {dtype!r}")
        return _DTYPE_NAMES[dtype.removeprefix("torch.")]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point dtype ({', '.join(_DTYPE_NAMES)}), got {dtype!r}")
    return dtype


class Engine:
    """Three decoding methods on one target (and one EAGLE-3 draft for the speculative ones).

    ``target``: a :class:`heterospec.TargetModel` or an in-memory ``transformers`` Llama model.
    ``draft``: a :class:`heterospec.Eagle3Draft` (``None`` allows only ``autoregressive``).
    ``config``: tree settings; default :func:`heterospec.config.default_config` for the device.
    ``bins``: entropy bins for HeteroSpec; default the calibration file next to the draft, else
    the documented fallback (with a warning).
    """

    def __init__(self, target, draft=None, *, tokenizer=None, config: Optional[SpecConfig] = None,
                 bins: Optional[EntropyBins] = None, device=None, dtype=None, max_length: Optional[int] = None,
                 attn_backend: str = "auto", draft_dir: Optional[str] = None):
        from .models.target import TargetModel

        if isinstance(target, (str, os.PathLike)):
            raise ValueError(f"Engine(target): got the path {os.fspath(target)!r}; load directories with "
                             "Engine.from_pretrained(target=..., draft=...)")
        if not isinstance(target, (TargetModel, torch.nn.Module)):
            raise ValueError(f"Engine(target): expected a heterospec TargetModel or a transformers Llama model, "
                             f"got {type(target).__name__}")
        dtype = _float_dtype("dtype", dtype)
        if device is not None and torch.device(device).type not in ("cpu", "cuda"):
            raise ValueError(f"Engine: device must be cpu or cuda, got {device!r}")
        if config is not None and not isinstance(config, SpecConfig):
            raise ValueError(f"Engine: config must be a heterospec.SpecConfig, got {type(config).__name__}")
        if bins is not None and not isinstance(bins, EntropyBins):
            raise ValueError(f"Engine: bins must be heterospec EntropyBins, got {type(bins).__name__}")
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
        self.config = config if config is not None else default_config(self.device)
        self.draft_dir = draft_dir
        self._bins = bins
        limit = int(getattr(target.config, "max_position_embeddings", 0) or 0) or 4096
        rotary = getattr(target, "rotary", None)
        if getattr(rotary, "exact_length", None):
            limit = min(limit, rotary.exact_length)       # longrope: its original (short) context
        self.max_length = int(max_length) if max_length is not None else limit
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        for model, what in ((target, "target"), (draft, "draft")):
            if hasattr(getattr(model, "rotary", None), "check_length"):
                model.rotary.check_length(self.max_length, f"Engine {what}")

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, target: Optional[str] = None, draft: Optional[str] = None, device="cpu",
                        dtype=None, config: Optional[SpecConfig] = None, draft_dtype=None,
                        **kwargs) -> "Engine":
        """Load a target directory and an EAGLE-3 draft directory; no arguments = the built-in pair.

        ``draft_dtype``: the draft's weights; default :func:`default_draft_dtype` (bfloat16 on
        CPUs with native bf16 matmul when the target runs float32, else the target's dtype)."""
        from .models.draft import Eagle3Draft
        from .models.target import TargetModel

        dtype, draft_dtype = _float_dtype("dtype", dtype), _float_dtype("draft_dtype", draft_dtype)
        if target is None:
            from .defaults import default_draft_dir, default_target_dir
            target = default_target_dir()
            draft = default_draft_dir() if draft is None else draft
        tgt = TargetModel.from_pretrained(target, device=device, dtype=dtype,
                                          attn_backend=kwargs.pop("attn_backend", "auto"))
        drf = None
        if draft is not None:
            drf = Eagle3Draft.from_pretrained(draft, target=tgt)
            w = tgt.lm_head.weight
            drf.to(device=w.device, dtype=draft_dtype or default_draft_dtype(w.device, w.dtype))
        return cls(tgt, drf, config=config, draft_dir=draft, **kwargs)

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

    # -- public API -----------------------------------------------------------------------------
    def generate(self, prompt: PromptLike, max_new_tokens: int = 256, method: str = "heterospec",
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None,
                 chat: bool = True, stream: Optional[Callable[[List[int]], None]] = None,
                 config: Optional[SpecConfig] = None) -> GenerationResult:
        """Generate for one prompt (a string, a list of token ids or a 1-D tensor).

        ``top_k`` / ``top_p`` / ``temperature`` process the *target's* distribution (sampling);
        the tree's branching factor is ``config.top_k``. ``stream`` receives the new token ids
        after every round.
        """
        cb = (lambda b, toks: stream(toks)) if stream is not None else None
        if not isinstance(prompt, (str, list, tuple, torch.Tensor)):
            raise ValueError(f"{_PROMPT_KINDS}; got {type(prompt).__name__}")
        return self.generate_batch([prompt], max_new_tokens, method, temperature, top_p, top_k, seed,
                                   chat, cb, config)[0]

    def generate_batch(self, prompts: Sequence[PromptLike], max_new_tokens: int = 256,
                       method: str = "heterospec", temperature: float = 0.0, top_p: float = 1.0,
                       top_k: int = 0, seed: Optional[int] = None, chat: bool = True,
                       stream: Optional[Callable[[int, List[int]], None]] = None,
                       config: Optional[SpecConfig] = None) -> List[GenerationResult]:
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
        params = SamplingParams(temperature, top_p, top_k, seed)
        cfg = config if config is not None else self.config
        if len(prompts) == 0:
            raise ValueError("generate_batch: no prompts given")
        ids = [self._encode(p, chat) for p in prompts]
        policy = self._policy(method, cfg)
        tree_cap = (policy.max_nodes + 1) if policy is not None else 1
        for i, p in enumerate(ids):
            if len(p) + max_new_tokens > self.max_length:
                which = "the prompt" if len(ids) == 1 else f"prompt {i}"
                raise ValueError(f"{which} has {len(p)} tokens; with max_new_tokens={max_new_tokens} that is "
                                 f"{len(p) + max_new_tokens} > max_length={self.max_length}")
        cache_len = max(len(p) for p in ids) + max_new_tokens + tree_cap + 1
        gen = make_generator(params.seed, self.device)

        with torch.inference_mode():
            t0 = time.perf_counter()
            st = self._prefill(ids, method, params, gen, cache_len, max_new_tokens, stream)
            while st.active():
                if method == "autoregressive":
                    self._decode_one(st, params, gen, max_new_tokens, stream)
                else:
                    t_draft = time.perf_counter()
                    tree = self._draft_tree(st, cfg, policy)
                    t_verify = time.perf_counter()
                    verdict = self._verify(st, tree, policy, params, gen)
                    t_end = time.perf_counter()
                    self._commit(st, tree, verdict, max_new_tokens, stream, t_verify - t_draft, t_end - t_verify)
            total = time.perf_counter() - t0
        results = []
        for b in range(st.size):
            s = st.stats[b]
            s.total_s = total
            s.new_tokens = len(st.outputs[b])
            text = self.tokenizer.decode(st.outputs[b], skip_special_tokens=True) if self.tokenizer else None
            results.append(GenerationResult(st.outputs[b], text, s, st.finished[b] or "length"))
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
            if prompt.dim() != 1:
                raise ValueError(f"a tensor prompt must be 1-D token ids, got shape {tuple(prompt.shape)}")
            if prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
                raise ValueError(f"a tensor prompt must hold integer token ids, got {prompt.dtype}")
            ids = prompt.tolist()
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

    def _policy(self, method: str, cfg: SpecConfig) -> Optional[BinPolicy]:
        if method == "autoregressive":
            return None
        if method == "eagle3":
            return BinPolicy(EntropyBins([]), cfg.replace(aggressive_bins=0), self.device)
        return BinPolicy(self.bins, cfg, self.device)

    # -- prefill --------------------------------------------------------------------------------
    def _prefill(self, ids: List[List[int]], method: str, params: SamplingParams, gen, cache_len: int,
                 max_new_tokens: int, stream) -> _Batch:
        B, n_max, dev = len(ids), max(len(p) for p in ids), self.device
        lens = torch.tensor([len(p) for p in ids], device=dev)
        tokens = torch.zeros(B, n_max, dtype=torch.int64, device=dev)
        for b, p in enumerate(ids):
            tokens[b, :len(p)] = torch.tensor(p, device=dev)
        positions = torch.arange(n_max, device=dev).expand(B, n_max)
        t0 = time.perf_counter()
        tcache = self.target.new_cache(B, cache_len)
        zeros = torch.zeros(B, dtype=torch.int64, device=dev)
        speculative = method != "autoregressive"
        logits, feats = self.target(tokens, positions, tcache, zeros, None, lens, return_features=speculative,
                                    logits_index=(lens - 1)[:, None], taps=self._taps)
        last = logits[:, 0]                                                      # [B, V]
        first = self._pick(last, params, gen)                                     # [B]

        st = _Batch(prefix_lens=lens.clone(), root=first, target_cache=tcache,
                    outputs=[[] for _ in range(B)], finished=[None] * B,
                    stats=[GenerationStats(method, prompt_tokens=len(p)) for p in ids])
        if speculative:
            # The draft entry at position p pairs the target feature at p with the token at p + 1.
            st.draft_cache = self.draft.new_cache(B, cache_len)
            st.draft_lens = torch.zeros(B, dtype=torch.int64, device=dev)
            st.ext_tokens = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
            st.ext_tokens[torch.arange(B, device=dev), lens - 1] = first
            st.ext_feats = feats
            st.ext_num = lens.clone()
        elapsed = time.perf_counter() - t0
        for b in range(B):
            st.stats[b].prefill_s = elapsed
        self._emit(st, [[int(t)] for t in first.tolist()], max_new_tokens, stream)
        return st

    def _pick(self, logits: torch.Tensor, params: SamplingParams, gen) -> torch.Tensor:
        if params.greedy:
            return logits.argmax(dim=-1)
        return sample(processed_probs(logits, params), gen)

    # -- autoregressive ---------------------------------------------------------------------------
    def _decode_one(self, st: _Batch, params: SamplingParams, gen, max_new_tokens: int, stream) -> None:
        t0 = time.perf_counter()
        logits, _ = self.target(st.root[:, None], st.prefix_lens[:, None], st.target_cache, st.prefix_lens,
                                None, None, return_features=False)
        st.prefix_lens += 1
        st.root = self._pick(logits[:, 0], params, gen)
        dt = time.perf_counter() - t0
        for b in st.active():
            st.stats[b].target_calls += 1
            st.stats[b].verified_tokens += 1
            st.stats[b].verify_s += dt
        self._emit(st, [[int(t)] for t in st.root.tolist()], max_new_tokens, stream)

    # -- draft ------------------------------------------------------------------------------------
    def _draft_tree(self, st: _Batch, cfg: SpecConfig, policy: BinPolicy) -> _Tree:
        draft, B, k, dev = self.draft, st.size, cfg.top_k, self.device
        ek = cfg.resolved_entropy_k
        rows = torch.arange(B, device=dev)

        # 1. Extend the draft over the tokens committed last round; its last output is the root's.
        n = int(st.ext_num.max())
        hidden = draft.extend(st.ext_tokens[:, :n], st.ext_feats[:, :n], st.draft_cache, st.draft_lens,
                              st.ext_num)
        st.draft_lens = st.draft_lens + st.ext_num                              # == st.prefix_lens
        h_root = hidden[rows, st.ext_num - 1]                                    # [B, H]
        lp, ids, ent = ops.topk_entropy(draft.logits(h_root), ek, None)
        lp, ids = lp[:, :k], ids[:, :k]                                          # [B, k]

        max_depth = cfg.depth + policy.max_extra_depth
        C = k + max_depth * k * k
        scores = torch.full((B, C), float("-inf"), device=dev)
        parents = torch.full((B, C), -1, dtype=torch.int64, device=dev)
        tokens = torch.zeros((B, C), dtype=torch.int64, device=dev)
        local = torch.full((B, C), float("-inf"), device=dev)
        entropy = torch.zeros((B, C), device=dev)       # path entropy of each candidate's path

        # Layer 1: children of the root.
        scores[:, :k], tokens[:, :k], local[:, :k] = lp, draft.to_target_ids(ids), lp
        entropy[:, :k] = ent[:, None]
        frontier = torch.arange(k, device=dev).expand(B, k)                     # candidate ids
        f_hidden = h_root[:, None, :].expand(B, k, h_root.shape[-1])             # parent outputs
        f_slot = torch.full((B, k), -1, dtype=torch.int64, device=dev)           # parents' tree slots
        state = draft.new_tree(B)

        depth_limit = torch.full((B,), cfg.depth, dtype=torch.int64, device=dev)
        budget = torch.full((B,), cfg.total_tokens - 1, dtype=torch.int64, device=dev)
        bins = torch.full((B,), -1, dtype=torch.int64, device=dev)
        pstar = torch.zeros(B, dtype=torch.int64, device=dev)
        if cfg.depth == 0:   # only the root's children: decide on layer 1
            pstar = self._pstar(scores, local, 0, k, cfg, first_layer=True)
            bins, extra, budget = policy.decide(entropy.gather(1, pstar[:, None])[:, 0].contiguous())
            depth_limit = extra
        for step in range(1, max_depth + 1):
            if step > cfg.depth and not bool((depth_limit >= step).any()):
                break
            # 2. One draft forward over the frontier (depth `step`), k children per node.
            positions = (st.prefix_lens + step - 1)[:, None].expand(B, k)
            f_tokens = tokens.gather(1, frontier)
            out = draft.tree_step(f_tokens, f_hidden, f_slot, positions, st.draft_cache, st.prefix_lens, state)
            lp, ids, ent = ops.topk_entropy(
                draft.logits(out).reshape(B * k, -1), ek, entropy.gather(1, frontier).reshape(-1))
            lp, ids = lp[:, :k].reshape(B, k, k), ids[:, :k].reshape(B, k, k)
            child_scores = scores.gather(1, frontier)[:, :, None] + lp              # [B, k, k]
            live = (depth_limit >= step)[:, None, None]
            child_scores = torch.where(live, child_scores, torch.full_like(child_scores, float("-inf")))

            base = k + (step - 1) * k * k
            sl = slice(base, base + k * k)
            scores[:, sl] = child_scores.reshape(B, k * k)
            parents[:, sl] = frontier[:, :, None].expand(B, k, k).reshape(B, k * k)
            tokens[:, sl] = draft.to_target_ids(ids).reshape(B, k * k)
            local[:, sl] = lp.reshape(B, k * k)
            entropy[:, sl] = ent.reshape(B, k, 1).expand(B, k, k).reshape(B, k * k)

            # 3. HeteroSpec: after the base depth, P*'s entropy picks the bin and its actions.
            if step == cfg.depth:
                pstar = self._pstar(scores, local, base, k, cfg)
                bins, extra, budget = policy.decide(entropy.gather(1, pstar[:, None])[:, 0].contiguous())
                depth_limit = cfg.depth + extra

            # Next frontier: the k best children by cumulative score (ties: lower index).
            order = torch.sort(child_scores.reshape(B, k * k), dim=1, descending=True, stable=True).indices[:, :k]
            frontier = base + order
            f_hidden = out.gather(1, (order // k)[:, :, None].expand(B, k, out.shape[-1]))
            f_slot = ((step - 1) * k + order // k)
        pstar_entropy = entropy.gather(1, pstar[:, None])[:, 0]
        return _Tree(scores, parents, tokens, local, budget,
                     depth=[int(d) + 1 for d in depth_limit.tolist()],
                     entropy=[float(x) for x in pstar_entropy.tolist()],
                     bins=[int(x) if policy.bins.num_bins > 1 else -1 for x in bins.tolist()],
                     pstar=[int(x) for x in pstar.tolist()])

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
    def _verify(self, st: _Batch, tree: _Tree, policy: BinPolicy, params: SamplingParams, gen):
        B, dev = st.size, self.device
        budget = tree.budget.clone()
        done = torch.tensor([f is not None for f in st.finished], device=dev)
        budget = torch.where(done, torch.zeros_like(budget), budget)   # finished requests: root only
        tree_cand, tree_parents, num_nodes = ops.select_tree_nodes(
            tree.scores, tree.parents, budget, policy.max_nodes)
        # Verify only as many positions as the largest tree in the batch: padding rows cost a
        # full target forward each, and Top-N pruning is worth nothing if they are computed.
        T = int(num_nodes.max())
        tree_cand, tree_parents = tree_cand[:, :T].contiguous(), tree_parents[:, :T].contiguous()
        cand_tokens = tree.tokens.gather(1, tree_cand.clamp(min=0))
        tree_tokens = torch.where(tree_cand >= 0, cand_tokens, st.root[:, None])      # root at position 0
        tree_mask, positions, first_child, next_sibling = ops.build_tree(
            tree_parents, num_nodes, st.prefix_lens)
        logits, feats = self.target(tree_tokens, positions, st.target_cache, st.prefix_lens, tree_mask,
                                    num_nodes, return_features=True, taps=self._taps)
        if params.greedy:
            accept_path, accept_len, bonus = ops.verify_greedy(
                tree_tokens, logits.argmax(dim=-1), first_child, next_sibling, num_nodes)
        else:
            probs = processed_probs(logits, params)
            T = tree_tokens.shape[1]
            coins = torch.rand((B, T), generator=gen, device=dev)
            final_coins = torch.rand((B,), generator=gen, device=dev)
            try:
                accept_path, accept_len, bonus = ops.verify_sampling(
                    tree_tokens, probs, first_child, next_sibling, num_nodes, coins, final_coins)
            except ValueError as e:
                # Only on the error path (no sync otherwise): name the target as the cause when it is.
                if bool(torch.isfinite(logits).all()):
                    raise
                raise ValueError("sampling: the target's distribution at a draft-tree node is not valid (NaN, inf "
                                 f"or no mass): the target model produced non-finite logits ({e})") from e
        st.target_cache.compact(accept_path, accept_len, st.prefix_lens)
        # Next extend: the draft sees root + accepted nodes with their target features, each
        # paired with the token that follows it (the next accepted node, or the bonus).
        path = accept_path.clamp(min=0)
        path_tokens = tree_tokens.gather(1, path)
        ext_tokens = torch.cat([path_tokens[:, 1:], path_tokens[:, :1]], dim=1)
        ext_tokens.scatter_(1, accept_len[:, None], bonus[:, None])
        st.ext_tokens = ext_tokens
        st.ext_feats = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1]))
        st.ext_num = accept_len + 1
        st.draft_lens = st.prefix_lens.clone()
        return _Verdict(tree_tokens, tree_cand, num_nodes, accept_path, accept_len, bonus)

    # -- commit -----------------------------------------------------------------------------------
    def _commit(self, st: _Batch, tree: _Tree, v: "_Verdict", max_new_tokens: int, stream,
                draft_s: float, verify_s: float) -> None:
        accept_len, bonus = v.accept_len, v.bonus
        acc = accept_len.tolist()
        paths = v.accept_path.tolist()
        toks = v.tree_tokens.tolist()
        bon = bonus.tolist()
        nn = v.num_nodes.tolist()
        cands = v.tree_cand.tolist()
        sel_scores = tree.scores.gather(1, v.tree_cand.clamp(min=0)).tolist()
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
            pstar_pos = cands[b].index(tree.pstar[b]) if tree.pstar[b] in cands[b][1:nn[b]] else 0
            pstar_rank = ranks[pstar_pos - 1] if pstar_pos > 0 else 0
            s = st.stats[b]
            s.rounds += 1
            s.target_calls += 1
            s.verified_tokens += nn[b]
            s.draft_s += draft_s
            s.verify_s += verify_s
            s.records.append(RoundRecord(accept_len=a, verified=nn[b], depth=tree.depth[b], entropy=tree.entropy[b],
                                         bin=tree.bins[b], tcr=tcr, pstar_rank=pstar_rank,
                                         pstar_accepted=pstar_pos > 0 and pstar_pos in paths[b][1:a + 1],
                                         draft_s=draft_s, verify_s=verify_s))
        running = torch.tensor([b in active for b in range(st.size)], device=self.device)
        st.prefix_lens = st.prefix_lens + torch.where(running, accept_len + 1, torch.zeros_like(accept_len))
        st.root = bonus
        self._emit(st, new, max_new_tokens, stream)

    def _emit(self, st: _Batch, new: List[List[int]], max_new_tokens: int, stream) -> None:
        """Append new tokens; stop at the first EOS or at max_new_tokens, never past either."""
        eos = set(self.target.config.eos_token_ids or [])
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
            if stream is not None and chunk:
                stream(b, chunk)


def _score_ranks(scores: List[float]) -> List[int]:
    """1-based rank of each score among ``scores`` (higher first, ties by position)."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    ranks = [0] * len(scores)
    for r, i in enumerate(order):
        ranks[i] = r + 1
    return ranks
