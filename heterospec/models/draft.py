"""EAGLE-3 draft model: one fused decoder layer over (token embedding, target feature).

Architecture (docs/design.md; reference eagle-mechanics §3.2), per position:

    g = fc(h) if h is the 3*Ht-wide target feature else h          # fc: 3Ht -> H, no bias
    residual = g
    x = cat(input_layernorm(embed(token)), hidden_norm(g))         # [.., 2H], embedding first
    a = residual + o_proj(attn(q/k/v_proj(x)))                     # q/k/v: 2H -> heads * head_dim
    a = a + mlp(post_attention_layernorm(a))                       # output a: pre-norm hidden
    logits = lm_head(norm(a))                                      # draft vocabulary (Vd rows)

Draft ids map to target ids through offsets: target_id = draft_id + d2t[draft_id]; t2d [V] bool
marks the target ids that are in the draft vocabulary.

Positions (docs/design.md): the draft entry at position p pairs the target feature at p with the
token at p + 1. The draft cache length equals the target's committed length L; a tree node at
depth d (target position L + d) is fed at draft position L + d - 1.

Attention: scaled_dot_product_attention with exact masks on every device. On CPU: bool masks and
``enable_gqa`` (the target's SDPA backend). On CUDA (``kernel_friendly_attention``): KV heads
expanded to the query heads and additive float masks (layers.sdpa_kernel_friendly), since a bool
mask with ``enable_gqa`` sends CUDA to the math kernel. Tree steps write their K/V into
preallocated per-round buffers (DraftTreeState); on CUDA the buffer also holds the committed
prefix (copied once per round), so every step attends over the same static [S + capacity] keys
with no concatenation (capture-friendly). On a CPU whose draft linears stream (StreamedDraft),
the extend and the tree steps attend with the tree_attention op instead, the tree's K/V written
to the draft cache past the committed prefix. A decision, not an omission: the draft is one layer whose tree steps put top_k queries
against the committed prefix plus a few dozen tree keys kept outside the cache, so FlashInfer's
paged-KV planning would cost more than it saves; the target, where attention is 30+ layers over the
whole tree, is what uses FlashInfer on CUDA. To revisit with a GPU profile (docs/gpu.md).

Checkpoint format: the public EAGLE-3 layout: config.json (LlamaConfig keys + draft_vocab_size,
optional target_hidden_size, eagle_config.eagle_aux_hidden_state_layer_ids (read as vLLM and
SGLang read them: :func:`aux_layers_from_ids`), no rope_theta means 10000) and model.safetensors
or pytorch_model.bin with keys fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d and
optionally embed_tokens.weight (else the target's embedding is used).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from .._checks import host_reads_allowed
from .._io import read_json_object
from .attention import causal_tree_mask, tree_op_serves
from .kv_cache import KVCache
from .layers import (MLP, QKVO, RMSNorm, Rotary, _glue, additive_mask, assign_weights, expand_kv_heads,
                     load_weight_file, rope_exact_length, rope_inv_freq, sdpa, sdpa_kernel_friendly)
from .linear import StreamPlans, layer_op_args, stream_group, stream_watch

_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")
# eagle_config.eagle_aux_hidden_state_layer_ids is read two ways in the wild. vLLM reads id k as
# the hidden state *entering* target layer k (HF's output_hidden_states[k], the EAGLE-3 reference's
# capture point); SGLang / SpecForge checkpoints, and heterospec's own before its sixty-ninth
# session, wrote "output of layer k" (entering k + 1). SGLang tells them apart by the first id: 1
# means the output reading (the embedding is never a tap), anything else the input one. We read the
# same way, an explicit AUX_CONVENTION in eagle_config first, and write the input reading with that
# key, so that vLLM, SGLang and this engine feed a draft the layers it was trained on. (vLLM fed the
# shipped draft, written [1, 14, 26] for inputs 2, 15, 27, the layers one earlier: its first draft
# token disagreed with ours at 29 % of the positions of the same text: bench/RESULTS.md,
# sixty-ninth session.)
AUX_CONVENTION = "heterospec_aux_layer_ids"   # "input": id k enters layer k; "output": id k leaves layer k


def aux_layers_from_ids(ids, convention: str | None = None) -> tuple[int, ...]:
    """The target layers whose *input* hidden states a draft consumes, from its config's
    ``eagle_aux_hidden_state_layer_ids`` (``convention``: ``"input"``, ``"output"``, or None for
    SGLang's rule: a first id of 1 means ``"output"``)."""
    ids = tuple(int(i) for i in ids)
    if convention is None:
        convention = "output" if ids and ids[0] == 1 else "input"
    if convention not in ("input", "output"):
        raise ValueError(f"eagle_config.{AUX_CONVENTION} must be 'input' or 'output', got {convention!r}")
    return tuple(i + 1 for i in ids) if convention == "output" else ids


_KNOWN_KEYS = {
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "draft_vocab_size", "target_hidden_size", "rms_norm_eps", "max_position_embeddings",
    "num_hidden_layers", "attention_bias", "bias", "mlp_bias", "eagle_config", "norm_before_residual",
    "torch_dtype", "dtype", "model_type", "architectures", "hidden_act", "tie_word_embeddings", *_ROPE_KEYS,
}


@dataclass
class DraftConfig:
    """The public EAGLE-3 config.json, parsed. Unknown keys are kept in `extra` and written back."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary (length of t2d)
    draft_vocab_size: int  # rows of lm_head (length of d2t)
    target_hidden_size: int  # Ht; fc maps 3 * Ht -> hidden_size
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    rope: dict = field(default_factory=dict)  # rope_theta / rope_scaling / rope_parameters as found
    aux_layers: tuple[int, ...] | None = None  # target layers whose INPUT hidden states are the features
    use_aux_hidden_state: bool = True  # False: no fc, features are already H wide
    attention_bias: bool = False
    mlp_bias: bool = False
    norm_before_residual: bool = False  # vLLM variant: residual = hidden_norm(g)
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        model_type = d.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"unsupported architecture: {model_type}")
        layers = d.get("num_hidden_layers", 1)
        if layers != 1:
            raise ValueError(f"unsupported EAGLE-3 draft: num_hidden_layers={layers} (only 1 is supported)")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported EAGLE-3 draft: hidden_act={d['hidden_act']!r}")
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            vocab = int(d["vocab_size"])
            inter = int(d["intermediate_size"])
        except KeyError as e:
            raise ValueError(f"EAGLE-3 config.json lacks {e.args[0]!r}") from None
        eagle = d.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=hidden,
            intermediate_size=inter,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
            target_hidden_size=int(d.get("target_hidden_size") or hidden),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rope={k: d[k] for k in _ROPE_KEYS if d.get(k) is not None},
            aux_layers=aux_layers_from_ids(ids, eagle.get(AUX_CONVENTION)) if ids is not None else None,
            use_aux_hidden_state=bool(eagle.get("use_aux_hidden_state", True)),
            attention_bias=bool(d.get("attention_bias", d.get("bias", False))),
            mlp_bias=bool(d.get("mlp_bias", False)),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            extra={k: v for k, v in d.items() if k not in _KNOWN_KEYS},
        )

    def to_dict(self, dtype: torch.dtype | None = None) -> dict:
        d = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            **self.rope,
        }
        if self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        if self.attention_bias:
            d["attention_bias"] = True
        if self.mlp_bias:
            d["mlp_bias"] = True
        if self.norm_before_residual:
            d["norm_before_residual"] = True
        eagle = {}
        if self.aux_layers is not None:
            eagle["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layers)
            eagle[AUX_CONVENTION] = "input"
        if not self.use_aux_hidden_state:
            eagle["use_aux_hidden_state"] = False
        if eagle:
            d["eagle_config"] = eagle
        if dtype is not None:
            d["torch_dtype"] = str(dtype).removeprefix("torch.")
        return {**self.extra, **d}

    def hf_rope_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, **self.rope,
        )


@dataclass
class DraftTreeState:
    """Tree-step K/V and ancestor rows of the nodes fed so far in this round (never committed).

    Storage is preallocated for `capacity` nodes and written in place (no per-step concatenation);
    it grows (a copy) only if a round feeds more nodes. Three layouts, picked at the first step:

    * compact (CPU default): ``kbuf``, ``vbuf`` ``[B, capacity, Hkv, D]``; a step attends over the
      committed prefix (cut to the longest one) concatenated with the nodes so far (the numerics
      of a plain concatenation);
    * static (CUDA default, ``static=True``): ``kbuf``, ``vbuf`` ``[B, S + capacity, Hq, D]``,
      KV heads expanded; the committed prefix is copied from the draft cache at the round's first
      step, node ``i`` sits at column ``S + i``, and every step attends over all ``S + capacity``
      columns with an additive float mask: the same shapes every step, no host read, eligible
      for the memory-efficient SDPA kernel. The buffers are recycled by the draft across rounds
      of the same shape (one live tree per draft and shape at a time);
    * cached (CPU streamed steps, ``STREAMED_DRAFT``): node ``i``'s K/V are written to the draft
      cache at slot ``prefix_lens[b] + i``, free until the next extend writes the committed
      entries there, and each step attends with the tree_attention op (prefix, then its ancestor
      columns); no ``kbuf`` / ``vbuf``. A round that runs out of free slots moves to the compact
      layout (a copy) and goes on.

    ``anc`` ``[B, capacity, capacity]`` bool: ``anc[b, i, j]`` = node ``j`` is ``i`` or an
    ancestor of ``i``. The properties ``k``, ``v``, ``anc`` view the nodes fed so far.
    """

    capacity: int | None = None  # nodes; None: chosen at the first step (16 steps of its k)
    static: bool | None = None  # None: the draft's kernel_friendly_attention (True on CUDA)
    n: int = 0
    offset: int = 0  # column of node 0 in kbuf / vbuf (S in the static layout)
    kbuf: torch.Tensor | None = None
    vbuf: torch.Tensor | None = None
    ancbuf: torch.Tensor | None = None
    # The CPU's streamed steps (STREAMED_DRAFT): node i's K/V sit in the draft cache at slot
    # prefix_lens[b] + i, past the committed entries (the next extend overwrites them), and no
    # kbuf / vbuf is kept. home: (cache, prefix_lens) of the round.
    cached: bool = False
    home: tuple | None = None

    @property
    def num_nodes(self) -> int:
        return self.n

    def _cached_rows(self, which: int) -> torch.Tensor:
        cache, prefix_lens = self.home
        c = (cache.k, cache.v)[which][0]                                   # [B, S, Hkv, D]
        slots = prefix_lens[:, None] + torch.arange(self.n, device=c.device)
        return c.gather(1, slots[:, :, None, None].expand(-1, -1, *c.shape[2:]))

    @property
    def k(self) -> torch.Tensor | None:  # [B, N, H, D] (H = Hq in the static layout)
        if self.cached:
            return self._cached_rows(0)
        return None if self.kbuf is None else self.kbuf[:, self.offset:self.offset + self.n]

    @property
    def v(self) -> torch.Tensor | None:
        if self.cached:
            return self._cached_rows(1)
        return None if self.vbuf is None else self.vbuf[:, self.offset:self.offset + self.n]

    @property
    def anc(self) -> torch.Tensor | None:  # [B, N, N] bool
        return None if self.ancbuf is None else self.ancbuf[:, :self.n, :self.n]


class TrainOutput(NamedTuple):
    logits: list  # per TTT step: [B, S, Vd] float32 (empty when return_logits=False)
    hidden: list  # per TTT step: [B, S, H] pre-norm draft hidden


# On the CPU a draft forward of a few rows - the extend over a round's committed tokens, a tree
# step - runs as one function where every linear of the layer takes its stream path
# (StreamedDraft): the same kernels without the modules' per-call dispatch, and attention by the
# tree_attention op over the draft cache, the round's tree nodes' K/V written there past the
# committed prefix (DraftTreeState.cached) instead of concatenated with it per step. Outside its
# linears, the dispatch and the concatenations were most of a CPU tree step's time
# (bench/RESULTS.md, "A streamed draft with 8-bit weights"). False runs the modules (A/B benchmarks).
STREAMED_DRAFT = True
# ... and from its QKV to its output as one op (decoder_layer_: the same kernels chained in C++,
# the same bits), where every row's K/V is written; False: call by call (A/B benchmarks, tests).
LAYER_OP = True
_TREE_ATTENTION = torch.ops.heterospec.tree_attention.default
_LAYER_OP = torch.ops.heterospec.decoder_layer_.default


class StreamedDraft(NamedTuple):
    """The draft layer's linears as :class:`~.linear.StreamCall` s at one row count (QKV and
    gate/up: one fused call or one per member); ``fc`` and ``lm_head`` where they stream at it
    too (else None: their modules run); ``layer_op`` the layer's ``decoder_layer_`` arguments
    where that op serves it (:func:`~.linear.layer_op_args`)."""
    fc: object | None
    qkv: list
    o_proj: object
    gate_up: list
    down: object
    lm_head: object | None
    layer_op: tuple | None = None


class DraftMidLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        H = c.hidden_size
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.self_attn = QKVO(2 * H, H, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.attention_bias)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.mlp = MLP(H, c.intermediate_size, c.mlp_bias)


def _load_state_dict(path: str) -> dict:
    """model.safetensors (or any *.safetensors) else pytorch_model.bin (weights_only)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        out = {}
        for f in files:
            out.update(load_weight_file(f))
        return out
    binf = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(binf):
        return load_weight_file(binf)
    raise FileNotFoundError(f"EAGLE-3 draft directory {path} has no model.safetensors or pytorch_model.bin")


def _outside(cols: torch.Tensor, hole: torch.Tensor) -> torch.Tensor:
    """[B, 1, W] bool: cache columns ``cols`` [W] outside each request's ``hole`` [B, 2] = [lo, hi)."""
    lo, hi = hole[:, 0, None, None], hole[:, 1, None, None]
    c = cols[None, None, :]
    return (c < lo) | (c >= hi)


def _committed(W: int, prefix_lens: torch.Tensor, hole: torch.Tensor | None) -> torch.Tensor:
    """[B, 1, W] bool: the cache slots a tree node sees, those below prefix_lens and outside the hole."""
    cols = torch.arange(W, device=prefix_lens.device)
    seen = cols[None, None, :] < prefix_lens[:, None, None]
    return seen if hole is None else seen & _outside(cols, hole)


def _target_spec(target) -> dict:
    """Sizes, embedding, dtype and device of a TargetModel or a transformers Llama model."""
    from .target import TargetModel

    if isinstance(target, TargetModel):
        c = target.config
        return dict(vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_layers, heads=c.num_heads,
                    kv_heads=c.num_kv_heads, head_dim=c.head_dim, inter=c.intermediate_size, eps=c.rms_norm_eps,
                    hf_config=c.hf_config, embedding=target.embed_tokens, dtype=target.dtype,
                    device=target.device, model=target)
    if hasattr(target, "get_input_embeddings") and hasattr(target, "config"):
        c = target.config
        emb = target.get_input_embeddings()
        heads = c.num_attention_heads
        return dict(vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers, heads=heads,
                    kv_heads=c.num_key_value_heads or heads,
                    head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                    inter=c.intermediate_size, eps=c.rms_norm_eps, hf_config=c, embedding=emb,
                    dtype=emb.weight.dtype, device=emb.weight.device, model=None)
    raise TypeError(f"expected a TargetModel or a transformers causal LM, got {type(target).__name__}")


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft. Build with `from_pretrained`, `for_target` or `Eagle3Draft(config)`."""

    #: "q8_0" once :meth:`round_weights_q8_0_` rounded the weights (None: as loaded).
    weight_form: str | None = None
    #: Attention in the form CUDA's fused SDPA kernels accept (expanded KV heads, additive float
    #: masks) and the static tree-buffer layout; None = on CUDA only (CPU keeps the bool-mask,
    #: enable_gqa numerics). Set True on CPU to exercise the CUDA formulation.
    kernel_friendly_attention: bool | None = None

    def __init__(self, config: DraftConfig, own_embedding: bool = False):
        super().__init__()
        # Static tree buffers, recycled across rounds of the same shape: only the latest shape's,
        # unless keep_tree_pools (the engine sets it while CUDA graphs replay rounds): then one set
        # per shape until release_tree_pools(), since a captured round keeps using the buffers it
        # was captured with and a graph keeps nothing alive itself (dropping them was a use-after-
        # free on the GPU).
        self._tree_pool: dict = {}
        self.keep_tree_pools = False
        self._plans = StreamPlans(self._build_plans, self._plan_weights)   # StreamedDraft or None
        c = self.config = config
        H = c.hidden_size
        self.fc = nn.Linear(3 * c.target_hidden_size, H, bias=False) if c.use_aux_hidden_state else None
        self.midlayer = DraftMidLayer(c)
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(c.vocab_size, H) if own_embedding else None
        self._shared_embedding: list[nn.Module] = []  # the target's; a list keeps it unregistered
        rope_cfg = c.hf_rope_config()
        inv_freq, scaling = rope_inv_freq(rope_cfg)
        self.rotary = Rotary(inv_freq, scaling, rope_exact_length(rope_cfg),
                             (rope_cfg.rope_parameters or {}).get("rope_type", "default"))

    # ---- properties -------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def aux_layers(self, num_layers: int | None = None) -> tuple[int, ...] | None:
        """Target layers whose INPUT hidden states this draft consumes: the layers the config names
        (:func:`aux_layers_from_ids`), else the EAGLE-3 default (2, L//2, L-3) for a target
        of `num_layers` layers, else None."""
        if self.config.aux_layers is not None:
            return self.config.aux_layers
        if num_layers is None:
            return None
        from .target import default_aux_layers

        return default_aux_layers(num_layers)

    @property
    def embedding(self) -> nn.Module:
        if self.embed_tokens is not None:
            return self.embed_tokens
        if not self._shared_embedding:
            raise RuntimeError(
                "this EAGLE-3 draft has no embed_tokens: attach it to its target first "
                "(Eagle3Draft.from_pretrained(path, target=...), draft.attach(target) or draft.set_embedding(...))"
            )
        return self._shared_embedding[0]

    def set_embedding(self, embedding: nn.Module) -> None:
        """Use `embedding` (an nn.Embedding of shape [vocab_size, hidden_size]) without owning it."""
        w = embedding.weight
        want = (self.config.vocab_size, self.config.hidden_size)
        if tuple(w.shape) != want:
            raise ValueError(f"embedding has shape {list(w.shape)}, the draft needs {list(want)} "
                             f"(vocabulary size, draft hidden size)")
        self.embed_tokens = None
        self._shared_embedding = [embedding]

    def attach(self, target) -> "Eagle3Draft":
        """Check that the draft fits `target`, share its embedding (unless the checkpoint has its
        own) and point the target's feature taps at the layers the draft config names, if any."""
        t = _target_spec(target)
        c = self.config
        if t["vocab"] != c.vocab_size:
            raise ValueError(f"vocabulary mismatch: the draft maps onto a vocabulary of {c.vocab_size} tokens, "
                             f"the target has {t['vocab']}")
        if t["hidden"] != c.target_hidden_size:
            raise ValueError(f"hidden-size mismatch: the draft expects target features of width "
                             f"3 x {c.target_hidden_size}, the target hidden size is {t['hidden']}")
        if self.embed_tokens is None:
            if t["hidden"] != c.hidden_size:
                raise ValueError(f"hidden-size mismatch: the draft (hidden {c.hidden_size}) has no embed_tokens and "
                                 f"cannot share the target's embedding (width {t['hidden']})")
            self.set_embedding(t["embedding"])
        aux = self.aux_layers(t["layers"])
        if any(i < 0 or i > t["layers"] for i in aux):
            raise ValueError(f"the draft taps target layers {list(aux)} but the target has {t['layers']} layers")
        if t["model"] is not None:
            # Also when the draft names no ids: a previous draft's taps must not linger.
            t["model"].config.aux_layers = tuple(aux)
        return self

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def for_target(cls, target, draft_vocab_size: int | None = None, seed: int = 0,
                   kept_ids=None, dtype: torch.dtype | None = None,
                   intermediate_size: int | None = None) -> "Eagle3Draft":
        """A randomly initialised draft sized after `target` (TargetModel or HF Llama).

        kept_ids: target ids of the draft vocabulary (any order, unique; sorted here); default the
        first `draft_vocab_size` ids. draft_vocab_size None = the target vocabulary (or len(kept_ids)).
        intermediate_size: the draft layer's MLP width (default: the target's). A wider MLP is
        the one way to give a one-layer EAGLE-3 draft more capacity within the public format
        (vLLM and this engine read the width from config.json).
        """
        t = _target_spec(target)
        V = t["vocab"]
        if kept_ids is not None:
            kept = torch.as_tensor(kept_ids, dtype=torch.long).flatten().sort().values
            if draft_vocab_size is not None and draft_vocab_size != kept.numel():
                raise ValueError(f"draft_vocab_size={draft_vocab_size} but {kept.numel()} kept ids were given")
            if kept.numel() == 0 or bool((kept[1:] == kept[:-1]).any()) or int(kept[0]) < 0 or int(kept[-1]) >= V:
                raise ValueError(f"kept_ids must be unique target ids in [0, {V})")
        else:
            Vd = V if draft_vocab_size is None else int(draft_vocab_size)
            if not 1 <= Vd <= V:
                raise ValueError(f"draft_vocab_size must be in [1, {V}], got {Vd}")
            kept = torch.arange(Vd)
        hf = t["hf_config"]
        rope = {k: v for k, v in (hf.rope_parameters or {}).items()}
        rope_cfg = {"rope_theta": rope.pop("rope_theta", 10000.0)}
        if rope.get("rope_type", "default") != "default":
            rope_cfg["rope_scaling"] = rope
        inter = t["inter"] if intermediate_size is None else int(intermediate_size)
        if inter < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {intermediate_size}")
        config = DraftConfig(
            hidden_size=t["hidden"], intermediate_size=inter, num_attention_heads=t["heads"],
            num_key_value_heads=t["kv_heads"], head_dim=t["head_dim"], vocab_size=V,
            draft_vocab_size=kept.numel(), target_hidden_size=t["hidden"], rms_norm_eps=t["eps"],
            max_position_embeddings=getattr(hf, "max_position_embeddings", 2048), rope=rope_cfg,
        )
        draft = cls(config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in draft.named_parameters():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        draft.d2t.copy_(kept - torch.arange(kept.numel()))
        draft.t2d.zero_()
        draft.t2d[kept] = True
        draft.to(device=t["device"], dtype=dtype or t["dtype"])
        return draft.attach(target)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, target=None, device=None,
                        dtype: torch.dtype | None = None) -> "Eagle3Draft":
        """Load a public-format EAGLE-3 checkpoint directory. `target` (TargetModel or HF model):
        check compatibility, share its embedding, default device/dtype to the target's."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"EAGLE-3 draft directory not found: {path}")
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"EAGLE-3 draft directory {path} has no config.json")
        config = DraftConfig.from_dict(read_json_object(cfg_path, "EAGLE-3 draft config"))
        tensors = _load_state_dict(path)
        if target is not None:
            t = _target_spec(target)
            device = t["device"] if device is None else device
            dtype = t["dtype"] if dtype is None else dtype
        device = "cpu" if device is None else device
        if dtype is None:
            dtype = next((v.dtype for k, v in tensors.items() if k == "lm_head.weight"), torch.float32)
        own = "embed_tokens.weight" in tensors
        if "fc.weight" not in tensors and config.use_aux_hidden_state:
            raise KeyError(f"{path}: missing weights ['fc.weight']")
        c = config
        Vd, V = c.draft_vocab_size, c.vocab_size
        if "d2t" not in tensors or "t2d" not in tensors:
            if Vd != V:
                raise KeyError(f"{path}: draft_vocab_size {Vd} != vocab_size {V} but the checkpoint lacks d2t / t2d")
            tensors = {**tensors, "d2t": torch.zeros(Vd, dtype=torch.long), "t2d": torch.ones(V, dtype=torch.bool)}
        tensors["d2t"] = tensors["d2t"].long()
        tensors["t2d"] = tensors["t2d"].bool()
        with torch.device("meta"):
            draft = cls(config, own_embedding=own)
        assign_weights(draft, tensors, dtype, device, requires_grad=True, what=path)
        draft.rotary.to(device)
        if target is not None:
            draft.attach(target)
        return draft

    def round_weights_q8_0_(self) -> "Eagle3Draft":
        """Round every linear weight (input width a multiple of 32) to the values of its Q8_0
        quantisation (:func:`~.linear.q8_0_values`), in place. On a CPU with tuned linears the
        draft then streams 8-bit codes: 1.25 bytes read per weight against float16's 2. Only the draft's proposals can move (its logits by the rounding); what is
        accepted is the target's alone. Needs float32 weights; ``weight_form`` becomes "q8_0"."""
        from .linear import q8_0_values
        if self.dtype != torch.float32:
            raise ValueError(f"round_weights_q8_0_: the draft's weights must be float32, not {self.dtype}")
        with torch.no_grad():
            for mod in self.modules():
                if isinstance(mod, nn.Linear) and mod.weight.shape[1] % 32 == 0:
                    mod.weight.copy_(q8_0_values(mod.weight))
        self.weight_form = "q8_0"
        return self

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype | None = torch.float16) -> None:
        """Write config.json + model.safetensors in the public EAGLE-3 layout (floats cast to dtype;
        None keeps the current dtype). embed_tokens.weight is written only if the draft owns one."""
        from safetensors.torch import save_file

        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        dtype = dtype or self.dtype
        sd = {}
        for k, v in self.state_dict().items():
            v = v.detach().to("cpu")
            sd[k] = (v.to(dtype) if v.is_floating_point() else v).contiguous()
        save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.config.to_dict(dtype), f, indent=2)

    # ---- the layer --------------------------------------------------------------------------

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        c = self.config
        self.rotary.check_length(max_length, "draft KV cache")
        return KVCache(1, batch_size, max_length, c.num_key_value_heads, c.head_dim, self.dtype, self.device)

    def _layer_in(self, input_ids: torch.Tensor, hidden: torch.Tensor):
        # input_ids: [B, T]; hidden: [B, T, 3Ht] (target features) or [B, T, H] (own output)
        # -> residual [B, T, H], x [B, T, 2H]
        g = self._fc_in(hidden, None)
        m = self.midlayer
        e = self.embedding(input_ids).to(self.dtype)
        hn = m.hidden_norm(g)
        residual = hn if self.config.norm_before_residual else g
        return residual, torch.cat((m.input_layernorm(e), hn), dim=-1)

    def _fc_in(self, hidden: torch.Tensor, fc_call) -> torch.Tensor:
        """g of the layer's input: fc of target features [.., 3Ht] (``fc_call``: its stream call,
        or None for the module), or the draft's own output [.., H] as it is."""
        w = hidden.shape[-1]
        if self.fc is not None and w == self.fc.in_features:
            x = hidden.to(self.dtype)
            return self.fc(x) if fc_call is None else fc_call(x)[0]
        if w == self.config.hidden_size:
            return hidden.to(self.dtype)
        fused = f"3 x {self.config.target_hidden_size} (target features) or " if self.fc is not None else ""
        raise ValueError(f"draft input hidden has width {w}, expected {fused}{self.config.hidden_size}")

    def _layer_out(self, residual: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        # o: [B, T, Hq, D] attention output -> pre-norm hidden [B, T, H]
        m = self.midlayer
        h = residual + m.self_attn.out(o)
        return h + m.mlp(m.post_attention_layernorm(h))

    # ---- the streamed layer (CPU; STREAMED_DRAFT) ---------------------------------------------

    def _build_plans(self, rows: int, dtype: torch.dtype) -> StreamedDraft | None:
        m, a = self.midlayer, self.midlayer.self_attn
        qkv, o = stream_group(a, QKVO.FUSABLE, rows, dtype), stream_group(a, ("o_proj",), rows, dtype)
        gate_up, down = stream_group(m.mlp, MLP.FUSABLE, rows, dtype), stream_group(m.mlp, ("down_proj",), rows, dtype)
        if None in (qkv, o, gate_up, down):
            return None
        fc = stream_group(self, ("fc",), rows, dtype) if self.fc is not None else None
        head = stream_group(self, ("lm_head",), rows, dtype)
        return StreamedDraft(fc and fc[0], qkv, o[0], gate_up, down[0], head and head[0],
                             layer_op_args(qkv, o[0], gate_up, down[0]))

    def _plan_weights(self) -> list:
        """What a plan reads (:func:`~.linear.stream_watch`); the norms' weights are read per call."""
        return stream_watch(((self.midlayer.self_attn, QKVO.FUSABLE + ("o_proj",)),
                             (self.midlayer.mlp, MLP.FUSABLE + ("down_proj",)),
                             (self, ("fc", "lm_head") if self.fc is not None else ("lm_head",))))

    def _streamed(self, rows: int) -> StreamedDraft | None:
        """The layer's stream calls for ``rows`` input rows, or None: the modules run (autograd on,
        not the CPU, a dtype without the glue ops, or a linear that takes another path there)."""
        if not STREAMED_DRAFT or torch.is_grad_enabled() or not _glue(self.lm_head.weight):
            return None
        return self._plans.get(rows, self.dtype)

    def _streams_into(self, cache: KVCache, prefix_lens: torch.Tensor, hole: torch.Tensor | None, T: int,
                      columns: int) -> bool:
        """Whether a forward of ``T`` rows per request can attend with tree_attention over ``cache``
        with ``columns`` slots of its own past each prefix: host reads allowed, no hole, and room."""
        if not tree_op_serves(T, prefix_lens, cache) or not host_reads_allowed(prefix_lens):
            return False
        if hole is not None and bool((hole[:, 1] > hole[:, 0]).any()):
            return False
        return int(prefix_lens.max()) + columns <= cache.max_length

    def _streamed_layer(self, plan: StreamedDraft, input_ids: torch.Tensor, hidden: torch.Tensor,
                        positions: torch.Tensor, cache: KVCache, num_valid: torch.Tensor | None,
                        prefix_lens: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
        """:meth:`_layer_in`, attention and :meth:`_layer_out` with ``plan``'s calls (the modules'
        kernels in their order): each row attends to the ``prefix_lens[b]`` committed slots and
        the tree columns of ``tree_mask`` [B, T, C], whose last ``T`` are the rows themselves: their
        K/V are written at cache slots ``prefix_lens[b] + C - T + j`` (rows ``j < num_valid[b]``;
        all without it), after the ``C - T`` earlier nodes of a tree step (none in an extend)."""
        norm = torch.ops.heterospec.rms_norm.default
        m, a = self.midlayer, self.midlayer.self_attn
        B, T = input_ids.shape
        g = self._fc_in(hidden, plan.fc)
        hn = norm(g, m.hidden_norm.weight, m.hidden_norm.eps)
        residual = hn if self.config.norm_before_residual else g
        e = self.embedding(input_ids).to(self.dtype)
        x = torch.cat((norm(e, m.input_layernorm.weight, m.input_layernorm.eps), hn), dim=-1)
        cos, sin = self.rotary(positions, self.dtype)
        if (LAYER_OP and plan.layer_op is not None and num_valid is None and cache.k.dtype == x.dtype
                and tuple(cos.shape) == (B, T, a.head_dim)):
            # (the raw op: the kernels it calls check their inputs)
            out = torch.empty_like(residual)
            _LAYER_OP(x, None, 0.0, m.post_attention_layernorm.weight, m.post_attention_layernorm.eps,
                      plan.layer_op[0], plan.layer_op[1], cos, sin, prefix_lens, tree_mask, a.scale, out,
                      cache.k[0], cache.v[0], residual)
            return out
        q, k, v = (out for call in plan.qkv for out in call(x))
        q, k = torch.ops.heterospec.rope.default(q.view(B, T, a.n_heads, a.head_dim),
                                                 k.view(B, T, a.n_kv_heads, a.head_dim), cos, sin)
        earlier = tree_mask.shape[2] - T
        cache.write(0, k, v.view(B, T, a.n_kv_heads, a.head_dim), prefix_lens + earlier if earlier else prefix_lens,
                    num_valid)
        o = _TREE_ATTENTION(q, cache.k[0], cache.v[0], prefix_lens, tree_mask, a.scale)
        h = residual + plan.o_proj(o.flatten(-2))[0]
        gate, up = (out for call in plan.gate_up for out in call(norm(h, m.post_attention_layernorm.weight,
                                                                         m.post_attention_layernorm.eps)))
        return h + plan.down(torch.nn.functional.silu(gate) * up)[0]

    # ---- inference --------------------------------------------------------------------------

    def extend(self, input_ids: torch.Tensor, features: torch.Tensor, cache: KVCache, prefix_lens: torch.Tensor,
               num_new: torch.Tensor, hole: torch.Tensor | None = None) -> torch.Tensor:
        """Append committed entries to the draft cache.

        input_ids [B, n]: token p + 1 of each entry; features [B, n, 3Ht]: target feature at p;
        entry j of request b sits at draft position prefix_lens[b] + j and is written to that cache
        slot for j < num_new[b] (other rows are padding: computed, never written). Each entry attends
        to the cache slots <= its position, except those in ``hole`` [B, 2] (int64 ``[lo, hi)`` per
        request; lo == hi: none): slots the draft never computed because its catch-up over a long
        plain stretch kept only the latest entries (see ``Engine.draft_window``). Returns the
        pre-norm hidden [B, n, H].
        """
        B, n = input_ids.shape
        if features.shape[:2] != (B, n):
            raise ValueError(f"features must be [{B}, {n}, ...] like input_ids, got {list(features.shape)}")
        if num_new.shape != (B,):
            raise ValueError(f"num_new must have shape [{B}], got {list(num_new.shape)}")
        S = cache.max_length
        if n > S:
            raise ValueError(f"draft extend: {n} entries are longer than the cache (max_length {S})")
        cache.check_fits(prefix_lens, num_new, "draft extend")
        positions = prefix_lens[:, None] + torch.arange(n, device=input_ids.device)  # [B, n]
        plan = self._streamed(B * n)
        if plan is not None and self._streams_into(cache, prefix_lens, hole, n, n):
            every = bool((num_new == n).all())     # then slice copies, not an indexed write
            return self._streamed_layer(plan, input_ids, features, positions, cache,
                                        None if every else num_new, prefix_lens,
                                        causal_tree_mask(B, n, input_ids.device))
        residual, x = self._layer_in(input_ids, features)
        attn = self.midlayer.self_attn
        cos, sin = self.rotary(positions, self.dtype)
        q, k, v = attn.qkv(x, cos, sin)
        cache.write(0, k, v, prefix_lens, num_new)
        # No host read on CUDA or in a sync-free round: attend over the whole cache.
        W = (S if prefix_lens.is_cuda or not host_reads_allowed(prefix_lens)
             else min(S, int(prefix_lens.max()) + n))
        cols = torch.arange(W, device=x.device)
        mask = cols[None, None, :] <= positions[:, :, None]  # [B, n, W]
        if hole is not None:
            mask = mask & _outside(cols, hole)
        attend = sdpa_kernel_friendly if self._kernel_friendly(x) else sdpa
        o = attend(q, cache.k[0, :, :W], cache.v[0, :, :W], mask, attn.scale)
        return self._layer_out(residual, o)

    def _kernel_friendly(self, x: torch.Tensor) -> bool:
        kf = self.kernel_friendly_attention
        return x.is_cuda if kf is None else bool(kf)

    def new_tree(self, batch_size: int, *, capacity: int | None = None,
                 static: bool | None = None) -> DraftTreeState:
        """A round's empty tree. capacity: nodes to preallocate (default: 16 steps of the first
        step's k; grows if exceeded); static: the layout (default: kernel_friendly_attention, i.e.
        static on CUDA). See DraftTreeState."""
        if capacity is not None and int(capacity) < 1:
            raise ValueError(f"new_tree: capacity must be >= 1, got {capacity}")
        return DraftTreeState(capacity=None if capacity is None else int(capacity), static=static)

    def resume_tree(self, state: DraftTreeState, cache: KVCache, n: int, like: torch.Tensor) -> None:
        """Point an empty static-layout ``state`` at this shape's recycled tree buffers, holding
        the first ``n`` nodes an earlier part of the same round fed (a split replayed round: the
        engine's decide graph feeds them, its deeper graph goes on from here). ``like``: a tensor
        of the round's batch, device and dtype family ([B, ...])."""
        if state.kbuf is not None or state.n:
            raise ValueError("resume_tree: the state must be empty")
        if state.static is None:
            state.static = self._kernel_friendly(like)
        if not state.static or not self.keep_tree_pools:
            raise ValueError("resume_tree needs the static tree layout with recycled buffers kept "
                             "(keep_tree_pools, set while CUDA graphs replay rounds)")
        if state.capacity is None or not 0 <= n <= state.capacity:
            raise ValueError(f"resume_tree: {n} nodes do not fit a tree of capacity {state.capacity}")
        self._tree_storage(state, cache, like.shape[0], 1, like)
        state.n = n

    def release_tree_pools(self) -> None:
        """Forget the recycled tree buffers (once no captured round can replay into them)."""
        self._tree_pool = {}

    def _tree_storage(self, state: DraftTreeState, cache: KVCache, B: int, k: int, x: torch.Tensor) -> None:
        """Allocate (first step) or grow the state's buffers so that k more nodes fit."""
        N = state.n
        if state.static is None:
            state.static = self._kernel_friendly(x)
        if state.ancbuf is not None and state.ancbuf.shape[0] != B:
            raise ValueError(f"tree_step: this tree holds {state.ancbuf.shape[0]} requests, got a batch of {B}")
        have = state.capacity if state.ancbuf is not None else 0
        if N + k <= have:
            return
        attn = self.midlayer.self_attn
        S = cache.max_length
        cap = max(state.capacity or 16 * k, N + k, 2 * have if have else 0)
        if state.cached:       # the nodes' K/V live in the cache: ancestor rows only
            ab = torch.zeros((B, cap, cap), dtype=torch.bool, device=x.device)
            if state.ancbuf is not None:
                ab[:, :N, :N] = state.ancbuf[:, :N, :N]
            state.ancbuf, state.capacity = ab, cap
            return
        if state.static:
            cap += (-(S + cap)) % 16  # 16-aligned key count: no mask padding copy in the fused kernel
            shape, off = (B, S + cap, attn.n_heads, attn.head_dim), S
        else:
            shape, off = (B, cap, attn.n_kv_heads, attn.head_dim), 0
        dev, dt = x.device, self.dtype
        key = (state.static, shape, dt, dev)
        pooled = self._tree_pool.get(key) if state.static and N == 0 else None
        if pooled is None:
            # zeros, not empty: masked keys must be finite under an additive mask
            pooled = (torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev),
                      torch.zeros((B, cap, cap), dtype=torch.bool, device=dev))
            if state.static:
                if self.keep_tree_pools:
                    self._tree_pool[key] = pooled
                else:
                    self._tree_pool = {key: pooled}  # keep one shape: the latest round's
        kb, vb, ab = pooled
        if state.kbuf is not None:  # grow: keep what this round wrote
            used = off + N
            kb[:, :used], vb[:, :used] = state.kbuf[:, :used], state.vbuf[:, :used]
            ab[:, :N, :N] = state.ancbuf[:, :N, :N]
        state.kbuf, state.vbuf, state.ancbuf, state.capacity, state.offset = kb, vb, ab, cap, off

    def tree_step(self, input_ids: torch.Tensor, hidden: torch.Tensor, parent_slots: torch.Tensor,
                  positions: torch.Tensor, cache: KVCache, prefix_lens: torch.Tensor,
                  state: DraftTreeState, hole: torch.Tensor | None = None) -> torch.Tensor:
        """Feed k tree nodes per request with exact ancestor masking.

        input_ids [B, k]: node tokens (target ids); hidden [B, k, H]: each node's parent output
        (for children of the root: the last extend output); parent_slots [B, k]: index of the parent
        among the nodes already in `state` (-1 = child of the root); positions [B, k]: draft
        positions (L + depth - 1). A node attends to draft cache slots < prefix_lens[b] (except
        those in ``hole``: see :meth:`extend`), its ancestors in `state` and itself. The nodes' K/V
        and ancestor rows are appended to `state`; no committed slot of the cache is written (the
        CPU's streamed steps keep the nodes' K/V in the free slots past each prefix,
        DraftTreeState.cached). Returns the pre-norm hidden [B, k, H].
        """
        B, k = input_ids.shape
        N = state.num_nodes
        if parent_slots.shape != (B, k) or positions.shape != (B, k):
            raise ValueError(f"parent_slots and positions must be [{B}, {k}], got "
                             f"{list(parent_slots.shape)}, {list(positions.shape)}")
        cache.check_prefix_lens(prefix_lens)
        # Host check on CPU only (a sync on CUDA); on CUDA a bad slot reads a clamped, wrong row.
        if (not parent_slots.is_cuda and host_reads_allowed(parent_slots)
                and bool(((parent_slots < -1) | (parent_slots >= N)).any())):
            raise ValueError(f"parent_slots must lie in [-1, {N}) (nodes already in the tree state)")
        plan = self._streamed(B * k) if state.static is not True and not self._kernel_friendly(input_ids) else None
        if N == 0 and state.ancbuf is None:
            state.cached = plan is not None and self._streams_into(cache, prefix_lens, hole, k, k)
            state.home = (cache, prefix_lens) if state.cached else None
        elif state.cached and (plan is None or not self._streams_into(cache, prefix_lens, hole, k, N + k)):
            self._spill(state, cache)      # out of free slots: the nodes move to buffers of their own
        if state.cached:
            state.static = False
            self._tree_storage(state, cache, B, k, hidden)
            rows = self._ancestor_rows(state, parent_slots, B, k)
            out = self._streamed_layer(plan, input_ids, hidden, positions, cache, None, prefix_lens,
                                       rows[:, :, :N + k])
            state.n = N + k
            return out
        residual, x = self._layer_in(input_ids, hidden)
        attn = self.midlayer.self_attn
        cos, sin = self.rotary(positions, self.dtype)
        q, kk, vv = attn.qkv(x, cos, sin)
        self._tree_storage(state, cache, B, k, x)
        cap, S = state.capacity, cache.max_length
        rows = self._ancestor_rows(state, parent_slots, B, k)
        if state.static:
            Hq = attn.n_heads
            if N == 0:  # the committed prefix, once per round
                state.kbuf[:, :S] = expand_kv_heads(cache.k[0], Hq)
                state.vbuf[:, :S] = expand_kv_heads(cache.v[0], Hq)
            state.kbuf[:, S + N:S + N + k] = expand_kv_heads(kk, Hq)
            state.vbuf[:, S + N:S + N + k] = expand_kv_heads(vv, Hq)
            prefix = _committed(S, prefix_lens, hole)                                   # [B, 1, S]
            mask = additive_mask(torch.cat((prefix.expand(B, k, S), rows), dim=-1), q.dtype)  # [B, k, S + cap]
            o = sdpa_kernel_friendly(q, state.kbuf, state.vbuf, mask, attn.scale)
        else:
            state.kbuf[:, N:N + k], state.vbuf[:, N:N + k] = kk, vv
            # No host read on CUDA or in a sync-free round: attend over the whole cache.
            W = S if prefix_lens.is_cuda or not host_reads_allowed(prefix_lens) else min(S, int(prefix_lens.max()))
            prefix = _committed(W, prefix_lens, hole)                                   # [B, 1, W]
            mask = torch.cat((prefix.expand(B, k, W), rows[:, :, :N + k]), dim=-1)
            keys = torch.cat((cache.k[0, :, :W], state.kbuf[:, :N + k]), 1)
            values = torch.cat((cache.v[0, :, :W], state.vbuf[:, :N + k]), 1)
            attend = sdpa_kernel_friendly if self._kernel_friendly(x) else sdpa
            o = attend(q, keys, values, mask, attn.scale)
        state.n = N + k
        return self._layer_out(residual, o)

    def _ancestor_rows(self, state: DraftTreeState, parent_slots: torch.Tensor, B: int, k: int) -> torch.Tensor:
        """The new nodes' ancestor rows, capacity wide: [B, k, cap] (columns >= N + k are False),
        also written to ``state.ancbuf``."""
        N, cap, dev = state.n, state.capacity, parent_slots.device
        if N:
            slots = parent_slots.clamp(0, N - 1)
            rows = state.ancbuf.gather(1, slots[..., None].expand(B, k, cap))
            rows = rows & (parent_slots >= 0)[..., None]
        else:
            rows = torch.zeros(B, k, cap, dtype=torch.bool, device=dev)
        rows[:, :, N:N + k] |= torch.eye(k, dtype=torch.bool, device=dev)
        state.ancbuf[:, N:N + k] = rows
        return rows

    def _spill(self, state: DraftTreeState, cache: KVCache) -> None:
        """A cached-layout round whose next step has no free slots left (or no stream path) goes on
        in the compact layout: its nodes' K/V are copied out of the cache into buffers of their
        own, the ancestor rows kept."""
        k, v = state.k, state.v                                      # [B, N, Hkv, D]
        B, N = k.shape[:2]
        shape = (B, state.capacity, *k.shape[2:])
        state.kbuf = torch.zeros(shape, dtype=k.dtype, device=k.device)
        state.vbuf = torch.zeros(shape, dtype=v.dtype, device=v.device)
        state.kbuf[:, :N], state.vbuf[:, :N] = k, v
        state.offset, state.cached, state.home = 0, False, None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., H] -> draft-vocabulary logits [..., Vd] float32."""
        plan = (self._streamed(hidden.numel() // hidden.shape[-1]) if hidden.dim() >= 2 and hidden.dtype == self.dtype
                else None)
        if plan is not None and plan.lm_head is not None:
            h = torch.ops.heterospec.rms_norm.default(hidden, self.norm.weight, self.norm.eps)
            return plan.lm_head(h)[0].float()
        return self.lm_head(self.norm(hidden)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids (target = draft + d2t[draft]); -1 stays -1."""
        ids = draft_ids.long()
        return torch.where(ids < 0, ids, ids + self.d2t[ids.clamp(min=0)])

    # ---- training ---------------------------------------------------------------------------

    def forward_train(self, input_ids: torch.Tensor, features: torch.Tensor,
                      attention_mask: torch.Tensor | None = None, ttt_steps: int = 1,
                      return_logits: bool = True) -> TrainOutput:
        """EAGLE-3 training-time test over full sequences.

        input_ids [B, S]: the sequence tokens; features [B, S, 3Ht]: target features of the same
        positions (hidden states entering the aux layers); attention_mask [B, S] (1 = real token,
        right padding) masks padded keys.

        Alignment: the draft entry at position p pairs feature(p) with token(p + 1).
          step 0, row p: input (features[p], ids[p+1]) at RoPE position p; predicts ids[p+2].
          step s, row p: input (hidden_{s-1}[p], ids[p+1+s]) at RoPE position p + s; predicts
                         ids[p+2+s]. Rows with p + 1 + s >= S get token 0 and are meaningless;
                         the valid rows of step s are p <= S - 3 - s for a loss against ids[p+2+s].
        Attention of row p at step s: step-0 keys at positions <= p (causal, padded keys removed)
        plus the step-1..s keys of the same row p (its own chain, itself included), exactly what
        `tree_step` sees for a chain node at depth s with committed length p + 1.

        Returns TrainOutput(logits=[B, S, Vd] float32 per step (empty if not return_logits),
        hidden=[B, S, H] per step). Step 0 equals `extend` on the same inputs.
        """
        B, S = input_ids.shape
        if features.shape[:2] != (B, S):
            raise ValueError(f"features must be [{B}, {S}, ...] like input_ids, got {list(features.shape)}")
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
        dev = input_ids.device
        attn = self.midlayer.self_attn
        Hq, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
        G = Hq // Hkv
        pos = torch.arange(S, device=dev)
        causal = pos[None, :] <= pos[:, None]  # [S(q), S(k)]
        mask0 = causal[None].expand(B, S, S)
        if attention_mask is not None:
            keep = attention_mask.bool()[:, None, :] | torch.eye(S, dtype=torch.bool, device=dev)[None]
            mask0 = mask0 & keep

        def shifted(s):  # ids[p + 1 + s], 0 past the end
            out = torch.zeros_like(input_ids)
            if s + 1 < S:
                out[:, : S - 1 - s] = input_ids[:, 1 + s:]
            return out

        hidden_in, logits, hiddens = features, [], []
        k0h = v0h = None
        diag_k, diag_v = [], []  # per step >= 1: [B, Hkv, 1, S, D]
        for s in range(ttt_steps):
            residual, x = self._layer_in(shifted(s), hidden_in)
            positions = (pos + s)[None].expand(B, S)
            cos, sin = self.rotary(positions, self.dtype)
            q, k, v = attn.qkv(x, cos, sin)  # [B, S, H*, D]
            if s == 0:
                o = sdpa(q, k, v, mask0, attn.scale)
                k0h = k.transpose(1, 2)[:, :, None]  # [B, Hkv, 1, S, D]
                v0h = v.transpose(1, 2)[:, :, None]
            else:
                qh = q.view(B, S, Hkv, G, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, S, D]
                diag_k.append(k.transpose(1, 2)[:, :, None])
                diag_v.append(v.transpose(1, 2)[:, :, None])
                scores = (qh @ k0h.transpose(-1, -2)) * attn.scale  # [B, Hkv, G, S, S]
                scores = scores.masked_fill(~mask0[:, None, None], float("-inf"))
                diag = torch.stack([(qh * kt).sum(-1) for kt in diag_k], dim=-1) * attn.scale  # [B,Hkv,G,S,s]
                p = torch.softmax(torch.cat((scores, diag), dim=-1).float(), dim=-1).to(qh.dtype)
                oh = p[..., :S] @ v0h  # [B, Hkv, G, S, D]
                for t, vt in enumerate(diag_v):
                    oh = oh + p[..., S + t, None] * vt
                o = oh.permute(0, 3, 1, 2, 4).reshape(B, S, Hq, D)
            h = self._layer_out(residual, o)
            hiddens.append(h)
            if return_logits:
                logits.append(self.logits(h))
            hidden_in = h
        return TrainOutput(logits, hiddens)
