"""Linear layers that use, per weight shape and row count, the fastest of three CPU GEMM paths.

Speculative decoding rests on one premise: the target verifies a few tokens in about the time it
decodes one, because a decode step is bound by reading the weights, not by arithmetic. On CPUs
the stock ``F.linear`` (MKL ``sgemm``) breaks the premise for small row counts: one row takes a
fast matrix-vector path, but two to sixteen rows take a general GEMM that re-reads the weights
per block of rows and can cost 2-4x a single row (bench/RESULTS.md, "small-row GEMM"). Two other
paths stream the weights once for such row counts:

- oneDNN's linear with a weight reordered once ahead of time (``torch.ops.mkldnn``, the path
  PyTorch's inductor uses for CPU inference), any float dtype;
- our own ``torch.ops.heterospec.stream_linear`` (csrc/cpu/linear.cpp), float32 or bfloat16:
  the weight packed once into blocks of 32 outputs, each block streamed once per call with every row's
  partial sums in registers. Its outputs do not depend on the row count (one FMA chain per
  output), so a verified tree gets bit for bit what one-token steps would.

Which path is fastest depends on the CPU, the thread count, the shape and the row count, so
nothing is assumed: :func:`tune_linears` times them per weight shape at row counts 1 to 16 (densely)
and up to 128 on this machine and each :class:`TunedLinear` dispatches on the rows of its input. The
decisions are cached per machine (CPU model and flags, threads, torch version, an emulated ISA)
in the heterospec cache.

Timing is *cache-cold*: in a decode step every weight is read once, from memory, since a model's
weights do not fit the last-level cache. A shape timed by calling one small weight over and over
times it from cache instead, where the stock matrix-vector path wins at one row; from memory the
reordered path streams faster (bench/RESULTS.md, sixth session). So each shape is timed
over enough copies of its weight, visited in turn, to exceed the last-level cache.

Some row counts run slower than a larger one: oneDNN's two-row kernel can stream the weights
slower than its four-row kernel (seen on an AVX-512 EPYC, every shape), so verifying a two-token
tree cost more than a four-token one. Where the reordered path at the next one or two
timed row counts is measured faster, the input is padded with zero rows up to that count and the
extra output rows dropped (:func:`pad_decisions`).

Sibling linears that read the same input (Q, K, V; gate and up) may run as one stacked
``stream_linear`` call (:class:`FusedStream`), where that was timed faster than the members'
own paths together.

A float32 weight that holds a block-quantised file's values exactly (the built-in target comes
from a GGUF of Q4_1 layers and a Q8_0 embedding) streams as its codes instead
(:func:`heterospec.ops.stream_linear_blocks`): the same outputs bit for bit, 4 or 8 bits read per
weight instead of 32. One whose values are all float16 values (the shipped draft, stored in
float16) streams as float16, 16 bits. :func:`tune_linears` finds such weights (``BLOCK_CODES``)
and times their stream path in that form.

A :class:`TunedLinear` is an ``nn.Linear`` (same parameters, same state dict). It falls back to
``F.linear`` whenever a packed or reordered copy could be stale or unusable: the weight was
replaced or modified in place since it was packed, autograd needs the weight's gradient, or the
input is not on the CPU or not in the weight's dtype.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import glob
import hashlib
import itertools
import json
import math
import operator
import os
import threading
import time
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

# Row counts timed per shape; an input with m rows uses the decision of the smallest timed row
# count >= m (the last for more rows). Dense up to 16: a verified tree has 3-17 rows, and each path's
# cost steps at different row counts (stream_linear's register tiles of up to 12 rows, oneDNN's
# own kernels), so 9 rows must not run the path timed fastest at 16 (bench/RESULTS.md, "row grid").
TUNE_ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64, 128)
# The reordered path must be this much faster to be used (the stock path is the reference).
MARGIN = 0.95
FORMAT = 11     # 11: on an AVX-512 CPU 1-2 rows may run the AVX2 block kernels (measured); 10: a target forward runs its layers as one op; 9: AVX2 kernels stream 1-2 rows in one pass over a block; 8: the row grid dense to 16; 7: fused groups timed in their own dtype; 6: bfloat16 streamed too; 5: fused groups timed; 4: stream_linear timed; 3: padded row counts; 2: cache-cold timing; 1: one cached weight
# Float32 weights that hold a block-quantised file's values exactly stream as their codes
# (module docstring); False streams every float32 weight as float32 (as before codes existed).
BLOCK_CODES = True
# Weight copies cycled while timing one shape add up to this many times the last-level cache.
COLD_FACTOR = 2
MAX_COPIES = 64


# Bumped whenever a layer's path decisions or packed copies change (set_stream, set_packed, a new
# FusedStream): callers that keep StreamCalls across forwards (TargetModel) rebuild them then.
_PATHS = [0]


def paths_generation() -> int:
    return _PATHS[0]


# Settled weights (StreamPlans.get). Checking that no weight a plan reads was replaced or written
# in place touches every weight of the model (~270 tensors, ~540 dict entries for the built-in
# target), cold in the cache after the layers streamed their weights: 3-4 % of a one-token step
# (bench/RESULTS.md, sixty-third session). Inside an engine call only the engine's own code runs
# between two forwards, and it changes weights only through path decisions (paths_generation,
# checked every time); so there the check runs once per epoch: the first forward of a call, and
# the first after any user code ran (a stream callback ends the epoch: weights_may_change).
# Per thread: another thread's forwards, outside any engine call, check every time.
_SETTLED = threading.local()
_EPOCHS = itertools.count(1)


@contextlib.contextmanager
def settled_weights():
    """The body of an engine call: the stream plans check their weights once, not per forward,
    until :func:`weights_may_change` or the end of the block. Code that changes a model's weights
    while the block runs (other than through :func:`tune_linears`) must call
    :func:`weights_may_change` after it."""
    prev = getattr(_SETTLED, "epoch", None)
    _SETTLED.epoch = next(_EPOCHS)
    try:
        yield
    finally:
        _SETTLED.epoch = prev


def weights_may_change() -> None:
    """Code that may have changed weights ran (e.g. a stream callback): inside
    :func:`settled_weights`, the next forward checks them again. A no-op outside."""
    if getattr(_SETTLED, "epoch", None) is not None:
        _SETTLED.epoch = next(_EPOCHS)


def _row_bucket(m: int) -> int:
    """Index into TUNE_ROWS of the decision used for ``m`` rows."""
    return min(bisect.bisect_left(TUNE_ROWS, m), len(TUNE_ROWS) - 1)


def row_bucket(m: int) -> int:
    """Index into TUNE_ROWS of the decision a layer uses for an input of ``m`` rows."""
    return _row_bucket(m)


def packed_linear_available() -> bool:
    """Whether this torch has oneDNN's reordered-weight linear (CPU builds with mkldnn)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), TUNE_ROWS[-1] // 8)


def _packed_forward(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def stream_linear_available(dtype: torch.dtype) -> bool:
    """Whether :func:`torch.ops.heterospec.stream_linear` serves weights of ``dtype`` (float32,
    bfloat16)."""
    return dtype in (torch.float32, torch.bfloat16) and hasattr(torch.ops.heterospec, "stream_linear")


def _stream_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.heterospec.stream_linear_pack.default(weight.detach())


def _stream_forward(x: torch.Tensor, packed, bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    if isinstance(packed, tuple):           # (codes, scales) of a block-coded float32 weight
        return torch.ops.heterospec.stream_linear_blocks.default(x, packed[0], packed[1], bias, n)
    return torch.ops.heterospec.stream_linear.default(x, packed, bias, n)


class StreamCall(NamedTuple):
    """A linear (or a fused sibling group) on its stream path, ready to call without its module:
    ``op(x, *args)`` -> ``[..., sum(splits)]`` (``splits``: the members' widths of a fused group,
    None for one linear). Made by :func:`stream_group`; it holds the packed copies, so a caller
    that keeps it across forwards rebuilds it when :func:`paths_generation` moves or a weight
    changes (``TargetModel._stream_plans``)."""
    op: object
    args: tuple
    splits: Optional[List[int]] = None

    def __call__(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        y = self.op(x, *self.args)
        # split_with_sizes: Tensor.split's own bits without its Python wrapper (per call, per layer)
        return (y,) if self.splits is None else y.split_with_sizes(self.splits, dim=-1)

    def weight_pair(self) -> Optional[Tuple[torch.Tensor, torch.Tensor, int]]:
        """``(weight, scales, out_features)`` as ``decoder_layer_`` takes a linear: the codes and
        scales of ``stream_linear_blocks``, or ``stream_linear``'s packed weight and an empty
        tensor; None for a call with a bias (the op takes none)."""
        if self.op is torch.ops.heterospec.stream_linear_blocks.default:
            codes, scales, bias, n = self.args
        else:
            (codes, bias, n), scales = self.args, torch.empty(0)
        return None if bias is not None else (codes, scales, int(n))


def _stream_call(packed, bias: Optional[torch.Tensor], n: int, splits: Optional[List[int]] = None) -> StreamCall:
    if isinstance(packed, tuple):           # (codes, scales) of a block-coded float32 weight
        return StreamCall(torch.ops.heterospec.stream_linear_blocks.default, (packed[0], packed[1], bias, n), splits)
    return StreamCall(torch.ops.heterospec.stream_linear.default, (packed, bias, n), splits)


def layer_op_args(qkv: list, o_proj, gate_up: list, down) -> tuple | None:
    """``(linears, out_features)`` for ``decoder_layer_`` from a layer's stream calls (a target's
    or the EAGLE-3 draft's): Q/K/V as one fused call or three, gate/up as one fused call or two
    of one width, no linear with a bias (else None: the layer runs call by call)."""
    def group(calls, members):
        if len(calls) == 1:
            splits = calls[0].splits
            return splits is not None and len(splits) == members
        return len(calls) == members and all(c.splits is None for c in calls)

    if not (group(qkv, 3) and group(gate_up, 2)):
        return None
    calls = [*qkv, o_proj, *gate_up, down]
    pairs = [call.weight_pair() for call in calls]
    if None in pairs:
        return None
    widths = [n for _, _, n in pairs]
    gate, up = gate_up[0].splits or widths[len(qkv) + 1:len(qkv) + 3]
    if gate != up:
        return None             # the op takes gate and up of one width
    return [t for w, s, _ in pairs for t in (w, s)], widths


def stream_group(owner: nn.Module, names: Sequence[str], rows: int, dtype: torch.dtype) -> Optional[List[StreamCall]]:
    """The calls that compute ``owner``'s linears ``names`` (siblings reading one input, or a
    single name) for an input of ``rows`` rows of ``dtype``, exactly as their modules would -
    the owner's :class:`FusedStream` where it serves the bucket, else each member's own stream
    path - or None where any of them would take another path (the caller runs the modules).
    For a caller that runs with autograd off (the engine decodes under inference mode): the
    modules' own paths also check that."""
    fused = getattr(owner, "_fused", None) if len(names) > 1 else None
    if fused is not None:
        call = fused.stream_call(rows, dtype)
        if call is not None:
            return [call]
    calls = []
    for name in names:
        lin = getattr(owner, name)
        call = lin.stream_call(rows, dtype) if isinstance(lin, TunedLinear) else None
        if call is None:
            return None
        calls.append(call)
    return calls


def q8_0_values(weight: torch.Tensor) -> torch.Tensor:
    """The values a GGUF Q8_0 quantisation of ``weight`` [N, K] (K a multiple of 32) holds, in
    float32: per output and group of 32 inputs, ``d = float16(absmax / 127)``, ``q = round(w / d)``
    in [-127, 127], ``w' = q * d`` (exact in float32). A float32 weight that holds them streams as
    its 8-bit codes (:func:`block_codes`): 1.25 bytes read per weight against float16's 2."""
    N, K = weight.shape
    if K % 32:
        raise ValueError(f"q8_0_values: the input width {K} is not a multiple of 32")
    g = weight.detach().float().reshape(N, K // 32, 32)
    d = (g.abs().amax(-1) / 127.0).half().float()
    q = (g / torch.where(d > 0, d, torch.ones_like(d))[..., None]).round().clamp(-127, 127)
    return (q * d[..., None]).reshape(N, K)


class StreamPlans:
    """A model's streamed forwards (its layers' :class:`StreamCall` s, from ``build(rows, dtype)``,
    or None where some linear takes another path), kept per row bucket and dtype while no path
    decision (:func:`paths_generation`) and no weight they read changed (replaced or written in
    place). ``weights()`` lists ``(owner dict, name)`` of every entry a plan reads."""

    def __init__(self, build, weights):
        self._build, self._weights, self._kept = build, weights, {}

    def __deepcopy__(self, memo):
        """A copied model's plans: its own methods (through ``memo``), nothing kept."""
        import copy
        return StreamPlans(copy.deepcopy(self._build, memo), copy.deepcopy(self._weights, memo))

    def get(self, rows: int, dtype: torch.dtype):
        key = (row_bucket(rows), dtype)
        kept = self._kept.get(key)
        epoch = getattr(_SETTLED, "epoch", None)
        if kept is not None and kept[0] == paths_generation():
            if epoch is not None and kept[3] == epoch:     # checked in this epoch (settled_weights)
                return kept[1]
            if _unchanged(kept[2]):
                kept[3] = epoch
                return kept[1]
        plans = self._build(rows, dtype)
        owners, names, held = [], [], []
        for d, n in self._weights():
            owners.append(d)
            names.append(n)
            held.append(d.get(n))
        tensors = [t for t in held if isinstance(t, torch.Tensor)]
        # [paths generation, plans, watch, the settled_weights epoch it was last checked in]
        self._kept[key] = [paths_generation(), plans, (owners, names, held, tensors, _tensor_states(tensors)), epoch]
        return plans


def stream_watch(groups: Sequence[Tuple[nn.Module, Sequence[str]]]) -> list:
    """``(dict, name)`` entries :class:`StreamPlans` watches for the stream calls of ``groups``
    (``(owner, linear names)``): each owner's fused group and modules, each linear's weight and bias."""
    out = []
    for owner, names in groups:
        out.append((owner.__dict__, "_fused"))
        for n in names:
            lin = getattr(owner, n)
            out += [(owner._modules, n), (lin._parameters, "weight")]
            if lin.bias is not None:
                out.append((lin._parameters, "bias"))
    return out


_VERSION, _DATA_PTR = operator.attrgetter("_version"), torch.Tensor.data_ptr


def _tensor_states(tensors: list) -> tuple:
    return list(map(_VERSION, tensors)), list(map(_DATA_PTR, tensors))


def _unchanged(watch) -> bool:
    """Whether every watched entry still holds the object it held, and no watched tensor was
    written in place or moved (checked once per forward over ~330 entries, hence maps: half the
    time of a generator of tuples)."""
    owners, names, held, tensors, states = watch
    return all(map(operator.is_, map(dict.get, owners, names), held)) and _tensor_states(tensors) == states


def _weight_state(w: torch.Tensor) -> Tuple:
    return (w.data_ptr(), w._version, w.dtype)


def block_codes_available() -> bool:
    """Whether float32 weights that hold block-quantised values stream as their codes here."""
    return BLOCK_CODES and hasattr(torch.ops.heterospec, "stream_linear_blocks")


def keep_block_source(weight: torch.Tensor, source: torch.Tensor) -> None:
    """Remember on ``weight``, a bfloat16 CPU parameter cast from the float32 ``source`` (a model
    loaded in bfloat16 from a float32 checkpoint), the block codes ``source`` holds exactly, if
    any: a bfloat16 weight alone no longer tells its codes. :func:`block_codes` streams the
    bfloat16 weight as them while it is unchanged since (``weight`` is ``source`` cast: the
    codes rounded give its values; a weight written since streams as bfloat16)."""
    if (weight.dtype != torch.bfloat16 or source.dtype != torch.float32 or source.dim() != 2
            or weight.device.type != "cpu" or source.device.type != "cpu" or not block_codes_available()):
        return
    from ..ops import stream_linear_pack_blocks
    with torch.no_grad():
        found = stream_linear_pack_blocks(source)
    if found is not None:
        weight._block_source = (found[0], found[1:], _weight_state(weight))


def block_codes(layer: nn.Linear) -> Optional[Tuple[str, object]]:
    """``(format, packed)`` of ``layer``'s CPU weight where it holds values of a narrower form
    exactly, else None: ``"q4_1"`` / ``"q8_0"`` with ``packed = (codes, scales)``
    (:func:`heterospec.ops.stream_linear_pack_blocks`), or ``"f16"`` with ``packed`` the float16
    weight packed for ``stream_linear``. A float32 weight is searched for them; a bfloat16 one
    takes the codes its float32 source held (:func:`keep_block_source`) while it is unchanged
    since the cast (``stream_linear_blocks`` rounds them to bfloat16 for a bfloat16 input).
    Found once per weight (kept on the layer while the weight is unchanged)."""
    w = layer.weight
    if not block_codes_available() or w.device.type != "cpu":
        return None
    source = getattr(w, "_block_source", None) if w.dtype == torch.bfloat16 else None
    if source is not None and (source[2] != _weight_state(w) or layer.__dict__.get("_bf16_codes_declined")):
        source = None                 # written since the cast, or measured slower here than its 16-bit stream
    if w.dtype != torch.float32 and source is None:
        return None
    seen = layer.__dict__.get("_block_codes_of")
    if seen is None or seen[0] != _weight_state(w):
        from ..ops import stream_linear_pack_blocks
        with torch.no_grad():
            if source is not None:
                found = source[:2]
            else:
                found = stream_linear_pack_blocks(w)
                if found is not None:
                    found = (found[0], found[1:])
                elif w.numel() and torch.equal(w.half().float(), w):
                    found = ("f16", _stream_pack(w.half()))
            seen = (_weight_state(w), found)
        layer.__dict__["_block_codes_of"] = seen
    return seen[1]


def _block_format(layer: nn.Linear) -> Optional[str]:
    found = block_codes(layer)
    return None if found is None else found[0]


class TunedLinear(nn.Linear):
    """``nn.Linear`` that runs ``stream_linear`` or oneDNN's reordered-weight linear for the row
    counts where :func:`tune_linears` measured it faster on this machine, ``F.linear`` otherwise."""

    _packed: Optional[torch.Tensor] = None
    _packed_of: Tuple = ()
    _use_packed: Tuple[bool, ...] = ()
    _pad_rows: Tuple[int, ...] = ()
    _stream: Optional[torch.Tensor] = None
    _stream_of: Tuple = ()
    _stream_format: Optional[str] = None      # the packed form's block_codes format (None: the weight's dtype)
    _use_stream: Tuple[bool, ...] = ()

    def set_stream(self, use_stream: Sequence[bool]) -> None:
        """Pack the weight for ``stream_linear`` now and use it for the row buckets where
        ``use_stream`` is True (one entry per TUNE_ROWS; it wins over the reordered path); all
        False drops the packed copy."""
        _PATHS[0] += 1
        self._use_stream = tuple(bool(u) for u in use_stream)
        if len(self._use_stream) != len(TUNE_ROWS):
            raise ValueError(f"set_stream: expected one entry per row bucket {list(TUNE_ROWS)}, "
                             f"got {len(self._use_stream)}")
        w = self.weight
        if any(self._use_stream):
            if not stream_linear_available(w.dtype):
                raise ValueError(f"set_stream: stream_linear serves float32 and bfloat16 weights, got {w.dtype}")
            codes = block_codes(self)
            self._stream = _stream_pack(w) if codes is None else codes[1]
            self._stream_format = None if codes is None else codes[0]
            self._stream_of = _weight_state(w)
        else:
            self._stream, self._stream_of, self._stream_format = None, (), None

    def stream_call(self, rows: int, dtype: torch.dtype) -> Optional[StreamCall]:
        """This layer's stream path for ``rows`` input rows of ``dtype`` as a :class:`StreamCall`,
        or None where :meth:`forward` would take another path (autograd aside: see
        :func:`stream_group`)."""
        if self._stream is None or not self._use_stream[_row_bucket(rows)]:
            return None
        w = self.weight
        if dtype != w.dtype or (w.data_ptr(), w._version, w.dtype) != self._stream_of:
            return None
        return _stream_call(self._stream, self.bias, self.out_features)

    def _usable(self, x: torch.Tensor, of: Tuple) -> bool:
        """A copy made of the weight as ``of`` describes still serves input ``x``."""
        w = self.weight
        return ((w.data_ptr(), w._version, w.dtype) == of and x.dtype == w.dtype and x.device.type == "cpu"
                and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)))

    def set_packed(self, use_packed: Sequence[bool], pad_rows: Optional[Sequence[int]] = None) -> None:
        """Reorder the weight now and use it for the row buckets where ``use_packed`` is True
        (one entry per TUNE_ROWS); all False drops the reordered copy. ``pad_rows`` (per bucket,
        0 = none) pads a packed bucket's input with zero rows up to that many rows."""
        _PATHS[0] += 1
        self._use_packed = tuple(bool(u) for u in use_packed)
        pad = [0] * len(self._use_packed) if pad_rows is None else [int(r) for r in pad_rows]
        if len(pad) != len(self._use_packed) or any(r and not u for r, u in zip(pad, self._use_packed)):
            raise ValueError(f"set_packed: pad_rows {pad} must have one entry per bucket, non-zero "
                             f"only where the packed path is used ({list(self._use_packed)})")
        self._pad_rows = tuple(pad)
        if any(self._use_packed):
            w = self.weight
            self._packed = _reorder(w)
            self._packed_of = (w.data_ptr(), w._version, w.dtype)
        else:
            self._packed, self._packed_of = None, ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self._packed
        rows = x.numel() // self.in_features if self.in_features else 0
        bucket = _row_bucket(rows)
        if self._stream is not None and self._use_stream[bucket] and self._usable(x, self._stream_of):
            return _stream_forward(x, self._stream, self.bias, self.out_features)
        if p is not None and self._use_packed[bucket]:
            if self._usable(x, self._packed_of):
                pad = self._pad_rows[bucket] if self._pad_rows else 0
                if pad > rows > 0:
                    xp = x.new_zeros(pad, self.in_features)
                    xp[:rows] = x.reshape(rows, self.in_features)
                    return _packed_forward(xp, p, self.bias)[:rows].reshape(*x.shape[:-1], self.out_features)
                return _packed_forward(x, p, self.bias)
        return F.linear(x, self.weight, self.bias)


class FusedStream:
    """Sibling linears that read the same input (an attention block's Q, K, V; an MLP's gate and
    up), run as one ``stream_linear`` call over their weights stacked, for the row buckets where
    :func:`tune_linears` measured that faster than the members' own paths. One call instead of
    three streams the same bytes with one dispatch, one thread fork and join, and longer rows of
    blocks per thread.

    Every member has a multiple of ``STREAM_BLOCK`` outputs, so each output is the same FMA chain
    over the same weights as in the member's own ``stream_linear`` call: the results are bit for
    bit the members' stream results (and row-invariant like them). Outputs are views into one
    [.., sum(out)] tensor. Returns None (the caller runs the members) where the bucket is not
    fused, or a member's weight was replaced or changed since packing, or autograd needs it."""

    def __init__(self, members: Sequence[nn.Linear], use: Sequence[bool]):
        from ..ops import STREAM_BLOCK
        w0 = members[0].weight
        if len(members) < 2 or any(m.in_features != members[0].in_features or m.weight.dtype != w0.dtype
                                   or m.weight.device != w0.device or (m.bias is None) != (members[0].bias is None)
                                   or m.out_features % STREAM_BLOCK for m in members):
            raise ValueError("FusedStream: members need one in_features, dtype, device and bias setting, "
                             f"and multiples of {STREAM_BLOCK} outputs each")
        if not stream_linear_available(w0.dtype):
            raise ValueError(f"FusedStream: stream_linear serves float32 and bfloat16 weights, got {w0.dtype}")
        _PATHS[0] += 1
        self.use = tuple(bool(u) for u in use)
        if len(self.use) != len(TUNE_ROWS):
            raise ValueError(f"FusedStream: expected one entry per row bucket {list(TUNE_ROWS)}, got {len(self.use)}")
        self.members = list(members)
        self.splits = [m.out_features for m in members]
        codes = [block_codes(m) for m in members]
        with torch.no_grad():
            if all(c is not None for c in codes) and len({c[0] for c in codes}) == 1:
                # blocks of 32 outputs: the members' packed forms stacked are the stacked weight's
                parts = [c[1] for c in codes]
                self.packed = (tuple(torch.cat(t) for t in zip(*parts)) if isinstance(parts[0], tuple)
                               else torch.cat(parts))
                self.format = codes[0][0]
            else:
                self.format = None
                self.packed = _stream_pack(torch.cat([m.weight.detach() for m in members]))
            self.bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        self.dtype = w0.dtype
        self._of = self._weights_now()

    def _weights_now(self) -> Tuple:
        return tuple((m.weight.data_ptr(), m.weight._version, m.weight.dtype) +
                     (() if m.bias is None else (m.bias.data_ptr(), m.bias._version)) for m in self.members)

    def stream_call(self, rows: int, dtype: torch.dtype) -> Optional[StreamCall]:
        """The stacked call for ``rows`` input rows of ``dtype`` as a :class:`StreamCall`, or None
        where :meth:`__call__` would return None (autograd aside: see :func:`stream_group`)."""
        if not self.use[_row_bucket(rows)] or dtype != self.dtype or self._weights_now() != self._of:
            return None
        return _stream_call(self.packed, self.bias, sum(self.splits), self.splits)

    def __call__(self, x: torch.Tensor) -> Optional[Tuple[torch.Tensor, ...]]:
        k = self.members[0].in_features
        if not self.use[_row_bucket(x.numel() // k if k else 0)]:
            return None
        if (x.dtype != self.dtype or x.device.type != "cpu" or self._weights_now() != self._of
                or (torch.is_grad_enabled() and (x.requires_grad or any(m.weight.requires_grad for m in self.members)))):
            return None
        return _stream_forward(x, self.packed, self.bias, sum(self.splits)).split(self.splits, dim=-1)


def fused_groups(model: nn.Module) -> List[Tuple[nn.Module, List[nn.Linear]]]:
    """``(owner, [member linears])`` for every module of ``model`` that names sibling linears it
    may run fused (a ``FUSABLE`` tuple of attribute names, read by :func:`tune_linears`)."""
    out = []
    for mod in model.modules():
        names = getattr(type(mod), "FUSABLE", None)
        if names:
            out.append((mod, [getattr(mod, n) for n in names]))
    return out


def chosen_ms(timing: dict, use_stream: Sequence[bool], use_packed: Sequence[bool]) -> List[float]:
    """Per TUNE_ROWS bucket, the milliseconds of the path a layer runs there (inf where not timed)."""
    by_rows = {r: i for i, r in enumerate(timing.get("rows", []))}
    out = []
    for b, r in enumerate(TUNE_ROWS):
        i = by_rows.get(r)
        if i is None or not timing.get("ok"):
            out.append(float("inf"))
            continue
        if use_stream[b]:
            out.append(stream_envelope(timing["stream_ms"])[i])
            continue
        out.append(timing["packed_ms" if use_packed[b] else "stock_ms"][i])
    return out


def _machine_key() -> dict:
    from ..costmodel import _cpu_info, isa_env
    # "timings": the format of the saved timings. 2: a reordered path that cannot run here no
    # longer hides the shape's stock and stream times (time_shape), so files of format 1, where
    # every bfloat16 shape of an AVX2-only CPU was "not ok", are timed again.
    key = {"torch": torch.__version__.split("+")[0], "threads": torch.get_num_threads(), "timings": 2,
           **_cpu_info()}
    isa = isa_env()
    if isa:                  # an emulated smaller ISA (MKL / oneDNN capped) is another machine
        key["isa_env"] = isa
    return key


def _cache_file() -> str:
    from ..defaults import cache_root
    key = hashlib.sha1(json.dumps(_machine_key(), sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(str(cache_root()), "costs", f"linear-{key}.json")


def _shape_key(layer: nn.Linear) -> str:
    """Timing key of a layer's shape, dtype, bias and block-code format (:func:`block_codes`)."""
    w = layer.weight
    fmt = _block_format(layer)
    return f"{layer.in_features}x{layer.out_features}-{str(w.dtype).removeprefix('torch.')}-" \
           f"{'bias' if layer.bias is not None else 'nobias'}" + (f"-{fmt}" if fmt else "")


@functools.lru_cache(maxsize=None)
def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache (Linux sysfs), 32 MiB where it cannot be read."""
    best = 0
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(d, "size")) as f:
                txt = f.read().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:], 1)
        try:
            best = max(best, int(txt.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or 32 << 20


def cold_copies(weight_bytes: int, llc_bytes: Optional[int] = None) -> int:
    """Copies of a weight to cycle through so that each call reads it from memory: together
    ``COLD_FACTOR`` times the last-level cache (1 when one copy alone is that large)."""
    llc = last_level_cache_bytes() if llc_bytes is None else llc_bytes
    return int(min(MAX_COPIES, max(1, math.ceil(COLD_FACTOR * llc / max(weight_bytes, 1)))))


def _best_ms(fns: Sequence, reps: int, warm_up: bool = True) -> float:
    """Fastest mean milliseconds per call of one pass over ``fns`` (each a call on its own
    weight copy), after a warm-up pass (``warm_up``: the first visit pays page faults and the
    primitive's creation for this row count; a later visit of the same calls need not)."""
    if warm_up:
        for fn in fns:
            fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        best = min(best, (time.perf_counter() - t0) / len(fns))
    return 1e3 * best


def _random_coded(N: int, K: int, fmt: str) -> Tuple[torch.Tensor, object]:
    """A random ``[N, K]`` float32 weight of format ``fmt`` and its packed form (for timing)."""
    if fmt == "f16":
        w = torch.randn(N, K).half()
        return w.float(), _stream_pack(w)
    codes = _random_codes(N, K, fmt)
    return _dequantized(*codes, N), codes


def _nbytes(packed) -> int:
    """Bytes of a packed weight (a tensor, or a tuple of tensors for block codes)."""
    parts = packed if isinstance(packed, tuple) else (packed,)
    return sum(t.numel() * t.element_size() for t in parts)


def _random_packed(N: int, K: int, fmt: str):
    """The packed form alone of a random ``[N, K]`` weight of format ``fmt``: the cold copies'
    (their float32 values are never read, and dequantizing each copy cost more than timing it)."""
    return _stream_pack(torch.randn(N, K).half()) if fmt == "f16" else _random_codes(N, K, fmt)


def _random_codes(N: int, K: int, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random codes and scales of an ``[N, K]`` weight in block format ``fmt`` (for timing)."""
    from ..ops import STREAM_BLOCK, STREAM_GROUP
    P, G = (N + STREAM_BLOCK - 1) // STREAM_BLOCK, K // STREAM_GROUP
    if fmt == "q4_1":
        codes = torch.randint(0, 256, (P, K, STREAM_BLOCK // 2), dtype=torch.uint8)
    else:
        codes = torch.randint(-128, 128, (P, K, STREAM_BLOCK), dtype=torch.int8)
    scales = (torch.rand(P, G, 2, STREAM_BLOCK) * 0.02).half().float()
    if fmt != "q4_1":
        scales[:, :, 1] = 0
    return codes, scales


def _dequantized(codes: torch.Tensor, scales: torch.Tensor, N: int) -> torch.Tensor:
    """The float32 ``[N, K]`` weight that block codes stand for (``d * q + m`` rounded once)."""
    from ..ops import STREAM_GROUP
    if codes.dtype == torch.uint8:
        q = torch.cat((codes & 15, codes >> 4), dim=-1)                   # [P, K, 32]
    else:
        q = codes
    q = q.double()
    P, K, B = q.shape
    d = scales[:, :, 0].double().repeat_interleave(STREAM_GROUP, dim=1)  # [P, K, 32]
    m = scales[:, :, 1].double().repeat_interleave(STREAM_GROUP, dim=1)
    w = (q * d + m).float()                                               # exact product, one rounding
    return w.permute(0, 2, 1).reshape(P * B, K)[:N].contiguous()


def time_shape(layer: nn.Linear, rows: Sequence[int] = TUNE_ROWS, budget_s: float = 0.4,
               copies: Optional[int] = None, fmt: Optional[str] = None) -> dict:
    """Stock, reordered and (float32, bfloat16) ``stream_linear`` milliseconds of ``layer``'s shape at each
    row count (the fastest of a few runs each, interleaved), cache-cold (``copies`` weights visited
    in turn, default :func:`cold_copies`), and whether the other paths' results matched (the
    weights and the inputs are random: the layer's own values are not touched). ``stream_ms`` is
    absent where ``stream_linear`` does not serve the dtype. ``fmt``: the weight is block-coded in
    that format (:func:`block_codes`): its stream path is timed as codes (``stream_linear_blocks``),
    the other paths on the float32 weight those codes stand for."""
    N, K = layer.out_features, layer.in_features
    w, coded = _random_coded(N, K, fmt) if fmt else (torch.randn_like(layer.weight, dtype=layer.weight.dtype), None)
    if fmt and fmt != "f16":
        w = w.to(layer.weight.dtype)     # a bfloat16 layer's codes stand for their bfloat16 rounding
    b = None if layer.bias is None else torch.randn_like(layer.bias)
    tol = dict(rtol=1e-2, atol=1e-2) if w.dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)
    x = torch.randn(2, layer.in_features, dtype=w.dtype)
    # A reordered path that cannot run here (oneDNN's bf16 reorder needs AVX-512BW or
    # AVX-NE-CONVERT: not on an AVX2-only CPU) or gives a wrong result is never chosen: its times
    # are infinite, and the stock and stream paths are still timed (before the eightieth session
    # the whole shape was reported not ok, so a bfloat16 model on an AVX2 CPU never streamed).
    packed_error = None
    try:
        packed = _reorder(w)
        if not torch.allclose(_packed_forward(x, packed, b).float(), F.linear(x, w, b).float(), **tol):
            packed_error = "reordered result differs from F.linear"
    except RuntimeError as exc:
        packed_error = str(exc).splitlines()[0][:200]
    stream = [coded if fmt else _stream_pack(w)] if stream_linear_available(w.dtype) else []
    if stream and not torch.allclose(_stream_forward(x, stream[0], b, w.size(0)), F.linear(x, w, b), **tol):
        stream = []                      # a wrong result: not timed, so never chosen
    w_bytes = _nbytes(w)
    n = cold_copies(w_bytes) if copies is None else max(1, int(copies))
    ws = [w] + [torch.randn_like(w) for _ in range(n - 1)]
    ps = [] if packed_error else [packed] + [_reorder(wi) for wi in ws[1:]]
    if not stream:
        ss = []
    elif fmt:                            # codes are smaller: as many copies as their own bytes need
        nc = cold_copies(_nbytes(coded)) if copies is None else n
        ss = stream + [_random_packed(N, K, fmt) for _ in range(nc - 1)]
    else:
        ss = stream + [_stream_pack(wi) for wi in ws[1:]]
    # Copies that together exceed the last-level cache are read from memory at every visit: a
    # second warm-up pass of them (round 1 created the primitives) warms nothing, and one timed
    # pass a round, itself a mean over every copy, reads what more passes read. Both are skipped
    # for them (a large shape's timing took ~2x longer otherwise); copies that fit keep both, so
    # the timings of small shapes mean what they did.
    llc = last_level_cache_bytes()
    beyond_cache = {"stock_ms": n * w_bytes > llc, "packed_ms": n * w_bytes > llc,
                    "stream_ms": sum(_nbytes(si) for si in ss) > llc}
    out = {"ok": True, "rows": list(rows), "copies": n, "stock_ms": [], "packed_ms": []}
    if packed_error:
        out["packed_error"] = packed_error
    if fmt:
        out["format"], out["stream_copies"] = fmt, len(ss)
    if stream:
        out["stream_ms"] = []
    for m in rows:
        x = torch.randn(m, layer.in_features, dtype=w.dtype)
        t0 = time.perf_counter()
        F.linear(x, w, b)
        one = max(time.perf_counter() - t0, 1e-6)
        reps = budget_s / len(rows) / (3 if stream else 2) / (one * n)      # passes within the budget
        paths = {"stock_ms": [lambda wi=wi: F.linear(x, wi, b) for wi in ws]}
        if ps:
            paths["packed_ms"] = [lambda pi=pi: _packed_forward(x, pi, b) for pi in ps]
        else:
            out["packed_ms"].append(float("inf"))
        if stream:
            paths["stream_ms"] = [lambda si=si: _stream_forward(x, si, b, w.size(0)) for si in ss]
        best = {k: float("inf") for k in paths}
        for r in range(2):                       # interleaved: drift hits every path
            for k, fns in paths.items():
                # (at least 2 timed passes a round, or 1 where one pass reads every copy from memory:
                # then the minimum over more passes is no lower, measured)
                k_reps = int(min(7, max(1 if beyond_cache[k] else 2, reps)))
                best[k] = min(best[k], _best_ms(fns, k_reps, warm_up=r == 0 or not beyond_cache[k]))
        for k, v in best.items():
            out[k].append(v)
    return out


def decisions(timing: dict) -> List[bool]:
    """Per TUNE_ROWS bucket: use the reordered path (measured ``MARGIN`` faster)."""
    if not timing.get("ok"):
        return [False] * len(TUNE_ROWS)
    by_rows = dict(zip(timing["rows"], zip(timing["stock_ms"], timing["packed_ms"])))
    return [r in by_rows and by_rows[r][1] < MARGIN * by_rows[r][0] for r in TUNE_ROWS]


def pad_decisions(timing: dict, reach: int = 2) -> List[int]:
    """Per TUNE_ROWS bucket: the row count to pad the input to (0 = none), where the reordered
    path at one of the next ``reach`` timed row counts was measured ``MARGIN`` faster than the
    best path at this bucket's own row count."""
    if not timing.get("ok"):
        return [0] * len(TUNE_ROWS)
    by_rows = dict(zip(timing["rows"], zip(timing["stock_ms"], timing["packed_ms"])))
    out = []
    for i, r in enumerate(TUNE_ROWS):
        best, pad = min(by_rows[r]) if r in by_rows else float("inf"), 0
        for j in range(i + 1, min(i + 1 + reach, len(TUNE_ROWS))):
            rj = TUNE_ROWS[j]
            if rj in by_rows and by_rows[rj][1] < MARGIN * best:
                best, pad = by_rows[rj][1], rj
        out.append(pad)
    return out


def stream_envelope(ms: Sequence[float]) -> List[float]:
    """A stream path's timings by row count made non-increasing towards fewer rows: each the
    least of its own and every larger row count's. The kernel reads the weight once and keeps
    each chunk of rows in registers, so fewer rows never cost more; a timing above a larger row
    count's is a disturbance. (A disturbed timing at 16 rows once sent the lm_head's 12- and
    16-row buckets to oneDNN, slower there than streaming: bench/RESULTS.md, fifty-ninth session.)"""
    out = [float(v) for v in ms]
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def stream_decisions(timing: dict, reach: int = 2) -> List[bool]:
    """Per TUNE_ROWS bucket: use ``stream_linear``, where it was measured ``MARGIN`` faster than
    the stock path and no slower than what :func:`decisions` and :func:`pad_decisions` would run
    instead."""
    if not timing.get("ok") or "stream_ms" not in timing:
        return [False] * len(TUNE_ROWS)
    by_rows = dict(zip(timing["rows"], zip(timing["stock_ms"], timing["packed_ms"],
                                           stream_envelope(timing["stream_ms"]))))
    use, pad = decisions(timing), pad_decisions(timing, reach)
    out = []
    for i, r in enumerate(TUNE_ROWS):
        if r not in by_rows:
            out.append(False)
            continue
        stock, packed, stream = by_rows[r]
        other = packed if use[i] else stock
        if pad[i]:
            other = min(other, by_rows[pad[i]][1])
        out.append(stream < MARGIN * stock and stream <= other)
    return out


_MEMORY: Dict[str, dict] = {}      # this process's timings, per machine file and shape


def tune_linears(models: Iterable[Optional[nn.Module]], progress: bool = True, stream: bool = True,
                 fuse: bool = True) -> dict:
    """Make every plain ``nn.Linear`` of ``models`` (CPU, float weights; subclasses are left alone) a :class:`TunedLinear` using
    the path measured fastest on this machine per row bucket (``stream=False``: choose between
    ``F.linear`` and the reordered path only, as before ``stream_linear`` existed; ``fuse=False``:
    no :class:`FusedStream` groups, as before they existed). Shapes not yet
    in the machine's cache file are timed now, once per machine (``progress``: with a progress bar), and saved.
    Returns ``{shape: {"timing": ..., "packed_rows": [...], ...}}`` for the shapes seen."""
    models = [m for m in models if m is not None]
    layers = [(name, mod) for model in models for name, mod in model.named_modules()
              if type(mod) in (nn.Linear, TunedLinear) and mod.weight.device.type == "cpu"
              and mod.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)]
    if not layers or not packed_linear_available():
        return {}
    path = _cache_file()
    saved = _MEMORY.get(path)
    if saved is None:
        saved = {}
        try:
            with open(path) as f:
                d = json.load(f)
            if d.get("format") == FORMAT and d.get("machine") == _machine_key():
                saved = d.get("shapes", {})
        except (OSError, ValueError):
            pass
        _MEMORY[path] = saved
    _choose_bf16_codes([mod for _, mod in layers], saved, path, progress)
    shapes = {}
    for _, mod in layers:
        shapes.setdefault(_shape_key(mod), mod)
    todo = [k for k in shapes if k not in saved]
    if todo:
        from tqdm.auto import tqdm
        load = _timing_load()
        with torch.inference_mode():
            for k in tqdm(todo, desc="timing linear layers", disable=not progress, unit="shape"):
                saved[k] = time_shape(shapes[k], fmt=_block_format(shapes[k]))
        _save_timings(path, saved, load, todo)
    report = {}
    for _, mod in layers:
        k = _shape_key(mod)
        use_stream = stream_decisions(saved[k]) if stream else [False] * len(TUNE_ROWS)
        pad = [0 if s else p for s, p in zip(use_stream, pad_decisions(saved[k]))]
        use = [not s and (u or bool(p)) for s, u, p in zip(use_stream, decisions(saved[k]), pad)]
        if not isinstance(mod, TunedLinear):
            mod.__class__ = TunedLinear        # same parameters, same state dict
        mod.set_packed(use, pad)
        mod.set_stream(use_stream)
        report[k] = {"timing": saved[k], "packed_rows": [r for r, u in zip(TUNE_ROWS, use) if u],
                     "padded_rows": {r: p for r, p in zip(TUNE_ROWS, pad) if p},
                     "stream_rows": [r for r, u in zip(TUNE_ROWS, use_stream) if u]}
    for model in models:
        for owner, _ in fused_groups(model):
            owner._fused = None
    if stream and fuse:
        _tune_fused(models, saved, path, report, progress)
    return report


# Row counts at which a bfloat16 layer's codes are timed against its 16-bit stream: a decode
# step, a small tree, a large one.
BF16_CODES_ROWS = (1, 4, 16)


def _choose_bf16_codes(layers: Sequence[nn.Linear], saved: dict, path: str, progress: bool = False) -> None:
    """Per shape of the bfloat16 layers that carry their float32 source's codes
    (:func:`keep_block_source`): stream them as the codes (rounded to bfloat16 in registers) or
    as 16-bit weights, whichever :func:`time_shape` measured faster here over
    ``BF16_CODES_ROWS`` (cache-cold, as every path). The codes read a quarter of the bytes but
    round every weight: at one row they ran slower than the 16-bit stream from cache on the
    Emerald Rapids Xeon and won from memory (bench/RESULTS.md, seventy-third session), so
    a CPU whose cache or bandwidth changes that trade decides for itself. A layer whose codes
    lose streams as bfloat16 (``_bf16_codes_declined``); the verdicts are kept with the
    machine's timings (keys ``bf16-codes:<shape>``)."""
    coded = [m for m in layers if m.weight.dtype == torch.bfloat16 and getattr(m.weight, "_block_source", None)]
    for m in coded:
        m.__dict__.pop("_bf16_codes_declined", None)
    groups: Dict[str, List[nn.Linear]] = {}
    for m in coded:
        fmt = _block_format(m)
        if fmt is not None:
            groups.setdefault(f"bf16-codes:{_shape_key(m)}", []).append(m)
    todo = [k for k in groups if k not in saved]
    if todo:
        from tqdm.auto import tqdm
        load = _timing_load()
        with torch.inference_mode():
            for k in tqdm(todo, desc="timing bfloat16 codes", disable=not progress, unit="shape"):
                m = groups[k][0]
                codes = time_shape(m, rows=BF16_CODES_ROWS, budget_s=0.2, fmt=_block_format(m))
                plain = time_shape(m, rows=BF16_CODES_ROWS, budget_s=0.2)     # the 16-bit stream
                saved[k] = {"rows": list(BF16_CODES_ROWS), "codes_ms": codes.get("stream_ms"),
                            "stream16_ms": plain.get("stream_ms")}
        _save_timings(path, saved, load, todo)
    for k, members in groups.items():
        t = saved[k]
        if t.get("codes_ms") is None or (t.get("stream16_ms") is not None
                                         and sum(t["codes_ms"]) > sum(t["stream16_ms"])):
            for m in members:
                m.__dict__["_bf16_codes_declined"] = True


def _timing_load():
    from ..costmodel import OtherLoad
    return OtherLoad().start()


def _save_timings(path: str, saved: dict, load, new: Sequence[str]) -> None:
    """Write the machine's timings, unless other processes kept the machine busy while the
    ``new`` shapes were timed: such times (seen: every path of a shape at 8 ms, a scheduler tick)
    would decide every later process's paths. They serve this process only, and are retimed by
    the next one."""
    from ..costmodel import BUSY_CORES
    busy = load.cores()
    if busy is not None and busy > BUSY_CORES:
        import warnings
        for k in new:
            saved[k] = {**saved[k], "busy_cores": busy}
        warnings.warn(f"linear layers timed while other processes kept {busy:.1f} CPU cores busy: their "
                      "paths may be wrong for this run and are not cached (timed again next time)", stacklevel=3)
    keep = {k: v for k, v in saved.items() if "busy_cores" not in v}
    try:
        from .._io import write_json_atomic
        write_json_atomic(path, {"format": FORMAT, "machine": _machine_key(), "shapes": keep}, indent=1)
    except OSError:
        pass                        # an unwritable cache only means timing again next time


def _fused_key(members: Sequence[nn.Linear]) -> str:
    return "fused:" + "+".join(_shape_key(m) for m in members)


def _fused_format(members: Sequence[nn.Linear]) -> Optional[str]:
    """The block-code format a group streams in: its members' common one, else None (float)."""
    fmts = {_block_format(m) for m in members}
    return fmts.pop() if len(fmts) == 1 else None


def _tune_fused(models, saved: dict, path: str, report: dict, progress: bool = False) -> None:
    """Give every fusable group of tuned float32 / bfloat16 linears its :class:`FusedStream`, used where one
    stacked call was measured ``MARGIN`` faster than the sum of the members' own chosen paths;
    members stop streaming themselves there (their packed copy is dropped if unused elsewhere)."""
    from ..ops import STREAM_BLOCK
    groups = []
    for model in models:
        for owner, members in fused_groups(model):
            if (all(isinstance(m, TunedLinear) and stream_linear_available(m.weight.dtype)
                    and m.weight.device.type == "cpu" and m.out_features % STREAM_BLOCK == 0 for m in members)
                    and len({m.in_features for m in members}) == 1
                    and len({m.bias is None for m in members}) == 1):
                groups.append((owner, members))
    todo = {}
    for _, members in groups:
        key = _fused_key(members)
        if key not in saved and key not in todo:
            todo[key] = (nn.Linear(members[0].in_features, sum(m.out_features for m in members),
                                   bias=members[0].bias is not None, dtype=members[0].weight.dtype),
                         _fused_format(members))
    if todo:
        from tqdm.auto import tqdm
        load = _timing_load()
        with torch.inference_mode():
            for key, (shape, fmt) in tqdm(todo.items(), desc="timing fused linear groups", disable=not progress,
                                          unit="group"):
                saved[key] = time_shape(shape, fmt=fmt)
        _save_timings(path, saved, load, list(todo))
    for owner, members in groups:
        key = _fused_key(members)
        t = saved[key]
        if not t.get("ok") or "stream_ms" not in t:
            continue
        each = [chosen_ms(saved[_shape_key(m)], m._use_stream, m._use_packed) for m in members]
        by_rows = dict(zip(t["rows"], stream_envelope(t["stream_ms"])))
        use = [r in by_rows and by_rows[r] < MARGIN * sum(ms[b] for ms in each) for b, r in enumerate(TUNE_ROWS)]
        if not any(use):
            continue
        owner._fused = FusedStream(members, use)
        for m in members:       # the fused call serves these buckets; the member's own stream is
            m.set_stream([s and not u for s, u in zip(m._use_stream, use)])    # for the others only
        report[key] = {"timing": t, "fused_rows": [r for r, u in zip(TUNE_ROWS, use) if u]}


def coded_formats(models: Iterable[Optional[nn.Module]]) -> List[str]:
    """The block-code formats the tuned linears of ``models`` stream in (sorted; [] for none)."""
    out = set()
    for model in models:
        for mod in (model.modules() if model is not None else ()):
            if isinstance(mod, TunedLinear) and mod._stream is not None:
                out.add(mod._stream_format)
            fused = getattr(mod, "_fused", None)
            if fused is not None:
                out.add(fused.format)
    return sorted(f for f in out if f)


def untune_linears(models: Iterable[Optional[nn.Module]]) -> None:
    """Back to ``F.linear`` everywhere (drops the reordered and packed copies)."""
    for model in models:
        if model is None:
            continue
        for mod in model.modules():
            if isinstance(mod, TunedLinear):
                mod.set_packed([False] * len(TUNE_ROWS))
                mod.set_stream([False] * len(TUNE_ROWS))
            if getattr(mod, "_fused", None) is not None:
                mod._fused = None
