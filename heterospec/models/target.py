"""The target: our own Llama forward over a static KV cache, weights from HF.

One forward serves prefill (a causal tree), plain decode (a one-node tree) and tree verification:
the T inputs of request b are written to cache slots prefix_lens[b] + j and attend to the slots
< prefix_lens[b] plus the tree columns their tree_mask row allows (docs/design.md, "Models").
It also returns the EAGLE-3 feature taps: the hidden states entering `config.aux_layers`,
concatenated low | mid | high.

Supported: model_type "llama" (Llama 2 / 3 / 3.1, Vicuna, SmolLM2; GQA, any rope_type, tied or
untied lm_head, optional attention / mlp biases).
"""

from __future__ import annotations

import glob
import os
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from .._checks import host_reads_allowed
from .._io import read_json_object
from .attention import TreeOpPlan, causal_tree_mask, make_backend
from .kv_cache import KVCache
from .layers import (MLP, QKVO, RMSNorm, Rotary, _glue, assign_weights, load_weight_file, rope_exact_length,
                     rope_inv_freq, rope_qk)
from .linear import StreamPlans, layer_op_args, stream_group, stream_watch


# A CPU forward whose every linear runs the stream path skips the modules' per-call dispatch
# (StreamedLayer: same kernels, same bits). False runs the modules (A/B benchmarks).
STREAMED_LAYERS = True

# A streamed layer whose Q/K/V run as one fused call hands its output to one op that rotates Q
# and K and writes K and V to the cache (``rope_kv_write_``), where the Python around it made
# about ten ATen calls a layer (a split, views, rope, per request a slice and a copy of K and of
# V). Same bits. False keeps those calls (A/B benchmarks).
ROPE_KV_WRITE = True

# Where every linear of a streamed layer runs fused as above and the attention is tree_attention,
# the whole layer runs as one op (``decoder_layer_``: its kernels chained in C++, no Python
# round trip per kernel). Same bits. False runs the layer call by call (A/B benchmarks).
LAYER_OP = True

# Where every layer runs as that op, the whole stack runs as one (``decoder_layers_``: the same
# layer op for each layer in turn, looped in C++). A one-token step spent a good part of its time
# between its layers' op calls (the Python layer object, the op's argument conversion, a view of
# each layer's cache) with a core idle meanwhile (bench/RESULTS.md, sixty-first session). Same
# bits. False runs one op a layer (A/B benchmarks).
STACK_OP = True


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3 taps: inputs of layers (2, L//2, L-3), clamped to [0, L] for tiny models."""
    return tuple(min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3))


@dataclass
class TargetConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    aux_layers: tuple[int, ...] = ()  # layers whose INPUT hidden states are the features
    hf_config: object = field(default=None, repr=False)  # the transformers LlamaConfig

    @classmethod
    def from_hf(cls, hf_config, generation_eos=None) -> "TargetConfig":
        model_type = getattr(hf_config, "model_type", None)
        if model_type != "llama":
            raise ValueError(f"unsupported architecture: {model_type}")
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported architecture: llama with hidden_act={act!r}")
        heads = hf_config.num_attention_heads
        eos = []
        for e in (hf_config.eos_token_id, generation_eos):
            for i in (e if isinstance(e, (list, tuple)) else [e]):
                if i is not None and int(i) not in eos:
                    eos.append(int(i))
        L = hf_config.num_hidden_layers
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=L,
            num_heads=heads,
            num_kv_heads=hf_config.num_key_value_heads or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            max_position_embeddings=hf_config.max_position_embeddings,
            bos_token_id=hf_config.bos_token_id,
            eos_token_ids=tuple(eos),
            pad_token_id=hf_config.pad_token_id,
            aux_layers=default_aux_layers(L),
            hf_config=hf_config,
        )


class DecoderLayer(nn.Module):
    def __init__(self, c: TargetConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = QKVO(c.hidden_size, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.attention_bias)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, c.mlp_bias)

    def forward(self, x, cos, sin, cache: KVCache, layer: int, prefix_lens, backend, plan, ragged=None):
        # x: [B, T, H]; ragged (B, T, rows): x is [1, N, H], the N real rows of the [B * T] grid;
        # only attention sees the padded grid, every linear layer runs on the real rows.
        attn = self.self_attn
        q, k, v = attn.qkv(self.input_layernorm(x), cos, sin)
        if ragged is not None:
            q, k, v = (_unpack(t, ragged) for t in (q, k, v))
        cache.write(layer, k, v, prefix_lens)  # the tree's K/V must be in the cache before attention
        o = backend.run(plan, q, cache.k[layer], cache.v[layer])
        if ragged is not None:
            o = _pack(o, ragged)
        x = x + attn.out(o)
        return x + self.mlp(self.post_attention_layernorm(x))

    def streamed(self, rows: int, dtype: torch.dtype) -> "StreamedLayer | None":
        """This layer as a :class:`StreamedLayer` for ``rows`` input rows of ``dtype``, or None
        where any of its linears takes another path than the stream one."""
        a, m = self.self_attn, self.mlp
        qkv, o = stream_group(a, QKVO.FUSABLE, rows, dtype), stream_group(a, ("o_proj",), rows, dtype)
        gate_up, down = stream_group(m, MLP.FUSABLE, rows, dtype), stream_group(m, ("down_proj",), rows, dtype)
        if None in (qkv, o, gate_up, down):
            return None
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        return StreamedLayer(n1.weight, n1.eps, qkv, o[0], n2.weight, n2.eps, gate_up, down[0],
                             a.n_heads, a.n_kv_heads, a.head_dim, layer_op_args(qkv, o[0], gate_up, down[0]))

    def weights(self) -> list:
        """``(dict, name)`` of everything a :class:`StreamedLayer` of this layer reads: its norm
        weights and its linears (:func:`~.linear.stream_watch`): what changes it."""
        return [(self.input_layernorm._parameters, "weight"), (self.post_attention_layernorm._parameters, "weight"),
                *stream_watch(((self.self_attn, QKVO.FUSABLE + ("o_proj",)), (self.mlp, MLP.FUSABLE + ("down_proj",))))]


class StreamedLayer(NamedTuple):
    """A :class:`DecoderLayer` whose linears all run their stream path at one row count: its
    norm weights and its linear groups as :class:`~.linear.StreamCall` (QKV and gate/up: one
    fused call or one per member)."""
    norm1: torch.Tensor
    eps1: float
    qkv: list
    o_proj: object
    norm2: torch.Tensor
    eps2: float
    gate_up: list
    down: object
    n_heads: int
    n_kv_heads: int
    head_dim: int
    layer_op: tuple | None = None   # (linears, out_features) of decoder_layer_, where it serves

    def __call__(self, x, cos, sin, cache: KVCache, layer: int, prefix_lens, host_lens, backend, plan, ragged=None):
        """:meth:`DecoderLayer.forward`: the same kernels in the same order, so the same bits,
        without the modules' per-call dispatch (about a third of a one-token float32 step on a
        2-core CPU, bench/RESULTS.md). ``host_lens``: ``prefix_lens.tolist()`` or None."""
        B, T, _ = x.shape
        fused_ok = _fused_ops_fit(x, cos, cache, ragged, self.head_dim)
        if LAYER_OP and fused_ok and self.layer_op is not None and type(plan) is TreeOpPlan:
            # the raw op: the kernels it calls check their inputs (the wrapper's Python checks,
            # once a layer, would cost what the op saves)
            out = torch.empty_like(x)
            torch.ops.heterospec.decoder_layer_.default(
                x, self.norm1, self.eps1, self.norm2, self.eps2, self.layer_op[0], self.layer_op[1], cos, sin,
                plan.prefix_lens, plan.tree_mask, plan.scale, out, cache.k[layer], cache.v[layer])
            return out
        norm = torch.ops.heterospec.rms_norm.default
        h = norm(x, self.norm1, self.eps1)
        if ROPE_KV_WRITE and fused_ok and len(self.qkv) == 1 and self.qkv[0].splits is not None:
            call = self.qkv[0]
            q = x.new_empty(B, T, self.n_heads, self.head_dim)
            kc, vc = cache.k[layer], cache.v[layer]
            # the raw op: it checks its inputs itself (the wrapper's Python checks, once a layer,
            # would cost what the op saves)
            torch.ops.heterospec.rope_kv_write_.default(call.op(h, *call.args), cos, sin, prefix_lens, q, kc, vc)
            o = backend.run(plan, q, kc, vc)
        else:
            q, k, v = (out for call in self.qkv for out in call(h))
            q, k = rope_qk(q.view(B, T, self.n_heads, self.head_dim),
                           k.view(B, T, self.n_kv_heads, self.head_dim), cos, sin)
            v = v.view(B, T, self.n_kv_heads, self.head_dim)
            if ragged is not None:
                q, k, v = (_unpack(t, ragged) for t in (q, k, v))
            cache.write(layer, k, v, prefix_lens, host_lens=host_lens)
            o = backend.run(plan, q, cache.k[layer], cache.v[layer])
        if ragged is not None:
            o = _pack(o, ragged)
        x = x + self.o_proj(o.flatten(-2))[0]
        h = norm(x, self.norm2, self.eps2)
        gate, up = (out for call in self.gate_up for out in call(h))
        return x + self.down(torch.nn.functional.silu(gate) * up)[0]


def _fused_ops_fit(x, cos, cache: KVCache, ragged, head_dim: int) -> bool:
    """Whether the fused layer ops (``rope_kv_write_``, ``decoder_layer_``, ``decoder_layers_``)
    take this call: per-token tables and a cache of ``x``'s dtype, and the real rows only."""
    B, T, _ = x.shape
    return (ragged is None and cache.k.dtype == x.dtype and cos.dtype == x.dtype
            and cos.shape == (B, T, head_dim))


class StreamedLayers(list):
    """A forward's :class:`StreamedLayer` per layer, and ``stack``: ``decoder_layers_``'s flat
    per-layer arguments ``(norms, eps, linears, out_features, layer_calls)`` where every layer
    runs as one op, else None."""

    def __init__(self, layers):
        super().__init__(layers)
        self.stack = None
        if layers and all(sl.layer_op is not None for sl in layers):
            self.stack = ([t for sl in layers for t in (sl.norm1, sl.norm2)],
                          [float(e) for sl in layers for e in (sl.eps1, sl.eps2)],
                          [t for sl in layers for t in sl.layer_op[0]],
                          [int(w) for sl in layers for w in sl.layer_op[1]],
                          [len(sl.layer_op[1]) for sl in layers])


def _pack(t: torch.Tensor, ragged) -> torch.Tensor:
    """[B, T, ...] -> [1, N, ...]: the real rows."""
    B, T, rows = ragged
    return t.reshape(B * T, *t.shape[2:]).index_select(0, rows)[None]


def _unpack(t: torch.Tensor, ragged) -> torch.Tensor:
    """[1, N, ...] -> [B, T, ...], zeros in the padding."""
    B, T, rows = ragged
    out = t.new_zeros(B * T, *t.shape[2:])
    return out.index_copy_(0, rows, t[0]).view(B, T, *t.shape[2:])


class TargetModel(nn.Module):
    def __init__(self, config: TargetConfig, attn_backend: str = "auto"):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        rope_cfg = c.hf_config
        inv_freq, scaling = rope_inv_freq(rope_cfg)
        self.rotary = Rotary(inv_freq, scaling, rope_exact_length(rope_cfg),
                             (rope_cfg.rope_parameters or {}).get("rope_type", "default"))
        self.tokenizer = None
        self._streamed = StreamPlans(self._build_stream_plans, self._stream_plan_weights)   # [StreamedLayer] or None
        self.attn_backend_name = attn_backend
        self._backend, self._backend_key = None, None

    # ---- loading ----------------------------------------------------------------------------

    @classmethod
    def _build(cls, config: TargetConfig, tensors, dtype, device, attn_backend, what) -> "TargetModel":
        with torch.device("meta"):
            model = cls(config, attn_backend)
        skip = ("lm_head.weight",) if config.tie_word_embeddings else ()
        assign_weights(model, tensors, dtype, device, requires_grad=False, what=what, skip=skip)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.rotary.to(device)
        model.name_or_path = os.fspath(what)  # where it came from, for provenance records
        model.eval()
        model.backend  # noqa: B018 (an unusable attn_backend fails at load time)
        return model

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device="cpu", dtype: torch.dtype | None = None,
                        attn_backend: str = "auto") -> "TargetModel":
        """Load a local HF Llama directory (config.json + safetensors, sharded or not; a tokenizer if
        present). Nothing is fetched from a hub. dtype None = the checkpoint's dtype."""
        from transformers import AutoConfig

        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"target model directory not found: {path}")
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise FileNotFoundError(f"target model directory {path} has no config.json")
        model_type = read_json_object(cfg_file, "target config").get("model_type")
        if model_type != "llama":
            raise ValueError(f"unsupported architecture: {model_type}")
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        gen_eos = None
        gen_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_file):
            gen_eos = read_json_object(gen_file, "target generation config").get("eos_token_id")
        config = TargetConfig.from_hf(hf_config, gen_eos)
        tensors = _read_weights(path)
        known = ("lm_head.weight", "embed_tokens.weight", "norm.weight")
        unused = [k for k in tensors if k not in known and not k.startswith("layers.")]
        unused += [k for k in tensors if k.startswith("layers.") and k.endswith(".bias") and not (
            config.attention_bias or config.mlp_bias)]
        unused = [k for k in unused if not k.endswith("rotary_emb.inv_freq")]
        if unused:
            warnings.warn(f"{path}: ignoring unexpected weights {unused[:8]}")
        if dtype is None:
            dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        model = cls._build(config, tensors, dtype, device, attn_backend, path)
        tok_files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
        if any(os.path.isfile(os.path.join(path, f)) for f in tok_files):
            from transformers import AutoTokenizer

            model.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return model

    @classmethod
    def from_hf(cls, hf_model, device=None, dtype: torch.dtype | None = None,
                attn_backend: str = "auto") -> "TargetModel":
        """From an in-memory transformers LlamaForCausalLM (weights shared when dtype/device match)."""
        config = TargetConfig.from_hf(hf_model.config)
        sd = hf_model.state_dict()
        tensors = {k.removeprefix("model."): v.detach() for k, v in sd.items()}
        ref = hf_model.get_input_embeddings().weight
        what = getattr(hf_model.config, "_name_or_path", "") or "hf_model"
        return cls._build(config, tensors, dtype or ref.dtype, device or ref.device, attn_backend, what)

    # ---- properties -------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def backend(self):
        """The attention backend, (re)built for the model's current device and dtype."""
        key = (self.attn_backend_name, self.device, self.dtype)
        if self._backend is None or self._backend_key != key:
            self._backend = make_backend(self.attn_backend_name, self.device, self.dtype)
            self._backend_key = key
        return self._backend

    def set_attn_backend(self, name: str) -> None:
        self.attn_backend_name, self._backend = name, None
        self.backend  # noqa: B018 (validate now)

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        c = self.config
        self.rotary.check_length(max_length, "target KV cache")
        return KVCache(c.num_layers, batch_size, max_length, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    # ---- forward ----------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, prefix_lens: torch.Tensor,
                tree_mask: torch.Tensor | None = None, num_nodes: torch.Tensor | None = None,
                return_features: bool = True, logits_index: torch.Tensor | None = None,
                taps: tuple[int, ...] | None = None, ragged: bool = False, attn=None):
        """input_ids, positions [B, T]; prefix_lens [B]; tree_mask [B, T, T] bool or None (causal);
        num_nodes [B] or None (all T real; padding rows only matter through tree_mask).
        logits_index [B, k] (optional, not in the design contract): compute logits only at these
        input rows -> [B, k, V]; with ``ragged`` they must be real rows (< ``num_nodes``).
        taps: the layers whose input hidden states form the features (default
        ``config.aux_layers``). The engine passes its draft's taps here, so one target can serve
        drafts that tap different layers without any state to keep in sync.
        ragged: with ``num_nodes``, run every linear layer (QKV, output, MLP, lm_head) on the
        ``sum(num_nodes)`` real tokens only; attention still sees the padded ``[B, T]`` grid. The
        padding rows of the returned logits and features are zeros. (Reads ``num_nodes`` on the
        host: a CPU path; on CUDA FlashInfer's ragged ``qo_indptr`` is the way.)
        attn: the attention backend of this call (default: the model's; the engine's CUDA-graph
        verification passes a planned :class:`SplitTreeAttention`).

        Returns (logits [B, T, V] float32, features [B, T, len(aux_layers) * H] or None).
        """
        B, T = input_ids.shape
        if positions.shape != (B, T):
            raise ValueError(f"positions must have shape {[B, T]}, got {list(positions.shape)}")
        if T > cache.max_length:
            raise ValueError(f"{T} inputs are longer than the KV cache (max_length {cache.max_length})")
        cache.check_fits(prefix_lens, T, "target forward")
        if tree_mask is None:
            tree_mask = causal_tree_mask(B, T, input_ids.device)
        elif tree_mask.shape != (B, T, T) or tree_mask.dtype != torch.bool:
            raise ValueError(f"tree_mask must be a bool [{B}, {T}, {T}] tensor, got {tree_mask.dtype} "
                             f"{list(tree_mask.shape)}")
        if num_nodes is not None and num_nodes.shape != (B,):
            raise ValueError(f"num_nodes must have shape [{B}], got {list(num_nodes.shape)}")
        c = self.config
        backend = self.backend if attn is None else attn
        plan = backend.plan(tree_mask, prefix_lens, cache, c.num_heads, c.head_dim**-0.5)
        x = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rotary(positions, x.dtype)
        pack = None
        if ragged and num_nodes is not None and B > 1:
            real = torch.arange(T, device=input_ids.device)[None, :] < num_nodes[:, None]
            pack = (B, T, real.reshape(-1).nonzero()[:, 0])
            if pack[2].numel() == B * T:
                pack = None                 # nothing to save
            else:
                x, cos, sin = _pack(x, pack), _pack(cos, pack), _pack(sin, pack)
        if taps is not None and any(not 0 <= int(i) <= c.num_layers for i in taps):
            raise ValueError(f"feature taps {list(taps)} out of range for a target of {c.num_layers} layers")
        aux = (c.aux_layers if taps is None else tuple(int(i) for i in taps)) if return_features else ()
        streamed = self._stream_plans(x)
        stack = streamed.stack if streamed is not None and STACK_OP and LAYER_OP else None
        if stack is not None and type(plan) is TreeOpPlan and _fused_ops_fit(x, cos, cache, pack, c.head_dim):
            # the raw op: the layer op's checks run in C++ for every layer before any runs
            out, features = torch.empty_like(x), x.new_empty(B, T, len(aux) * c.hidden_size)
            torch.ops.heterospec.decoder_layers_.default(x, *stack, cos, sin, plan.prefix_lens, plan.tree_mask,
                                                         plan.scale, list(aux), out, features, cache.k, cache.v)
            x = out
        else:
            x, features = self._layers(x, cos, sin, cache, prefix_lens, backend, plan, pack, streamed, aux)
        features = features if return_features else None
        if pack is not None and features is not None:
            features = _unpack(features, pack)
        if logits_index is not None and pack is not None:
            # Row (b, t) of the grid is packed row start[b] + t, for the real t < num_nodes[b].
            if bool(((logits_index < 0) | (logits_index >= num_nodes[:, None])).any()):
                raise ValueError("target forward: logits_index must name real rows (0 <= index < num_nodes)")
            start = torch.cumsum(num_nodes, 0) - num_nodes
            x = x[0, (start[:, None] + logits_index).reshape(-1)].view(B, -1, x.shape[-1])
        elif logits_index is not None:
            x = x.gather(1, logits_index[..., None].expand(-1, -1, x.shape[-1]))
        logits = self.lm_head(self.norm(x)).float()
        if pack is not None and logits_index is None:
            logits = _unpack(logits, pack)
        return logits, features

    def _layers(self, x, cos, sin, cache, prefix_lens, backend, plan, pack, streamed, aux) -> tuple:
        """The layers one call each (streamed, else the modules): ``(x, features)``, the features
        the hidden states entering the layers ``aux`` side by side (``aux`` empty: ``[..., 0]``)."""
        taps = {}
        host_lens = (prefix_lens.tolist() if streamed is not None and x.shape[0] <= 4 and host_reads_allowed(prefix_lens)
                     else None)
        for i, layer in enumerate(self.layers):
            if i in aux:
                taps[i] = x
            if streamed is not None:
                x = streamed[i](x, cos, sin, cache, i, prefix_lens, host_lens, backend, plan, pack)
            else:
                x = layer(x, cos, sin, cache, i, prefix_lens, backend, plan, pack)
        if self.config.num_layers in aux:
            taps[self.config.num_layers] = x
        return x, (torch.cat([taps[i] for i in aux], dim=-1) if aux else x.new_empty(*x.shape[:-1], 0))

    def _stream_plans(self, x: torch.Tensor) -> list | None:
        """Every layer as a :class:`StreamedLayer` for input ``x`` ([B, T, H], or [1, N, H]
        packed), or None (the modules run) unless every linear streams at this row count, the norms and RoPE run as the CPU
        glue ops and autograd is off. Kept per row bucket and dtype while no path decision
        (:func:`~.linear.paths_generation`) and no weight it reads changed (replaced or written)."""
        if not STREAMED_LAYERS or torch.is_grad_enabled() or not _glue(x, self.norm.weight):
            return None
        return self._streamed.get(x.shape[0] * x.shape[1], x.dtype)

    def _build_stream_plans(self, rows: int, dtype: torch.dtype) -> "StreamedLayers | None":
        layers = [layer.streamed(rows, dtype) for layer in self.layers]
        return None if None in layers else StreamedLayers(layers)

    def _stream_plan_weights(self) -> list:
        return [w for layer in self.layers for w in layer.weights()]


def _indexed_shards(path: str, index_name: str) -> list[str] | None:
    """The shard files a sharded checkpoint's index names (None without an index); a shard the
    index names but the directory lacks is an error naming the file."""
    index = os.path.join(path, index_name)
    if not os.path.isfile(index):
        return None
    weight_map = read_json_object(index, "checkpoint index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"checkpoint index {index} has no weight_map of tensor names to shard files")
    files = sorted({os.path.join(path, v) for v in weight_map.values()})
    missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"target model directory {path}: missing weight shards {missing} (named in {index_name})")
    return files


def _read_weights(path: str) -> dict:
    """All tensors of a local HF checkpoint, keys without the "model." prefix."""
    files = _indexed_shards(path, "model.safetensors.index.json")
    if files is None:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:  # the older layout (Vicuna, early Llama 2 uploads)
        files = _indexed_shards(path, "pytorch_model.bin.index.json")
        if files is None:
            files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
        if not files:
            raise FileNotFoundError(f"target model directory {path} has no *.safetensors (or pytorch_model*.bin) weights")
    tensors = {}
    for f in files:
        sd = load_weight_file(f)
        for k, v in sd.items():
            tensors[k.removeprefix("model.")] = v
    return tensors
