"""CUDA graphs of a speculative round's two halves (docs/gpu.md section 3).

A capture-ready round (``Engine.static_rounds``) has static shapes per configuration and no host
read inside its two halves, the draft (extend, tree steps, bin decision) and the verification
(node selection, tree, target forward, verify, KV compaction, the next extend's inputs). Each half
is captured once per configuration and replayed from then on; the launch overhead of a few hundred
small kernels becomes one ``cudaGraphLaunch``.

The contract of a captured half (:class:`RoundGraphs`):

- **Inputs** are copied into static buffers owned by the graph before every replay (never
  rebound). An input may be narrower than its buffer along dimension 1 (the draft's pending
  extend, whose width grows with plain steps): it fills the leading columns and the rest keeps
  older values, which the half treats as padding.
- **Outputs** live in the graph's private memory pool and stay valid until the same graph replays
  again. The engine reads a round's outputs within the round, and what outlives it (the next
  extend's inputs, the next root) only as the input of a later replay, which copies it first.
- **State updated in place** (both KV caches) must be the same tensors at capture and replay: the
  configuration key holds their storage, and a batch that reallocates its caches (dropping
  finished requests) gets new graphs; the old ones are freed.
- **Python values** (the plan's shape: depths and node capacity; sampling parameters, the
  generator) are baked in at capture; the key holds every one that changes what the half
  computes. The plan's per-bin edges, depths and budgets are inputs, so plans that differ only in
  them share a graph; a split round (``Engine.bin_graphs``) sizes its buffers for the engine's
  envelope, so plans that differ in their deepest bin or largest budget share its graphs too.
- **Everything else a half reads** (weights, the draft's recycled tree buffers,
  attention workspaces) must outlive the graph: a graph holds addresses, not references. Pass
  such objects in ``keep``, or let their owner hold them while graphs live (the draft keeps one
  tree-buffer set per shape until the graphs are dropped).

A configuration is captured the second time it is seen: the first round of a configuration runs
eagerly (a one-off plan never pays for a capture). At most ``max_graphs`` are kept, least recently
used dropped. A capture that fails (an op that synchronises, a library that cannot be captured)
is reported once as a warning and that configuration runs eagerly; ``counts["failed"]`` says so.

``emulate=True`` stands in for CUDA on any device with the same contract, so the engine's graph
plumbing is tested on CPU: "capture" runs the half once on the static inputs and keeps its outputs;
"replay" runs it again on the static inputs and copies the results into the kept outputs. A caller
that reads an output after its graph replayed again computes something else there too; a half
that reads a tensor other than those it read at capture (a Python attribute rebound since)
raises, and so does the replay of a half one of whose captured reads has been freed since (a
graph keeps no tensor alive: on a GPU that replay reads and writes freed memory).
"""

from __future__ import annotations

import collections
import warnings
from typing import Callable, Hashable, List, Optional, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

Tensors = Sequence[Optional[torch.Tensor]]


_HOST_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)


class _ExternalReads(TorchDispatchMode):
    """Emulation only: the storages an emulated half reads that it did not create itself (static
    inputs, caches, weights, plan tensors). A CUDA graph reads the storages it was captured with,
    so a replay that reads any other one (a live Python attribute rebound since the capture)
    would be wrong on a GPU; the emulation raises instead, as it does for a tensor built from
    host data inside the half (a copy a capture cannot hold)."""

    def __init__(self):
        super().__init__()
        self.made, self.read = set(), {}   # read: storage address -> (weak ref, shape), no strong ref

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            # .item() / int(t) / bool(t) / nonzero: a device-to-host sync, which a capture refuses
            raise RuntimeError(f"a captured round half reads a value on the host ({func}): a CUDA graph "
                               "cannot hold a device-to-host sync; run it under heterospec._checks.sync_free() "
                               "or move the read out of the half")
        if func is torch.ops.aten.lift_fresh.default:
            # torch.tensor(<host data>): on CUDA a pageable host-to-device copy, not capturable
            raise RuntimeError("a captured round half builds a tensor from host data (torch.tensor / "
                               "as_tensor): a CUDA graph cannot capture that copy; make it before the capture")
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr and ptr not in self.made and ptr not in self.read:
                    # Weakly: a CUDA graph does not keep what it reads alive either. A storage that
                    # dies while the graph lives is a use-after-free at the next replay (checked
                    # there); a strong reference here would hide exactly that.
                    self.read[ptr] = (StorageWeakRef(t.untyped_storage()), list(t.shape))
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.add(t.untyped_storage().data_ptr())
        return out


def _load(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into the leading part of the static buffer ``dst`` (same rank, each dim <=)."""
    if src.shape == dst.shape:
        dst.copy_(src)
        return
    if src.dim() != dst.dim() or any(s > d for s, d in zip(src.shape, dst.shape)):
        raise ValueError(f"graph input of shape {list(src.shape)} does not fit its static buffer {list(dst.shape)}")
    dst[tuple(slice(0, s) for s in src.shape)].copy_(src)


class _CapturedHalf:
    """One captured function: static inputs, its graph (or its emulation) and its outputs."""

    def __init__(self, fn: Callable[..., List[Optional[torch.Tensor]]], inputs: Tensors,
                 shapes: Sequence[Optional[Sequence[int]]], generator: Optional[torch.Generator],
                 emulate: bool, keep: tuple):
        self.fn, self.emulate, self.generator = fn, emulate, generator
        self.keep = keep                      # objects the graph's kernels read (plan tensors, caches)
        self.static_in = []
        for t, shape in zip(inputs, shapes):
            if t is None:
                self.static_in.append(None)
                continue
            buf = torch.zeros(tuple(shape) if shape is not None else t.shape, dtype=t.dtype, device=t.device)
            _load(buf, t)
            self.static_in.append(buf)
        self.graph = None
        self.static_out: List[Optional[torch.Tensor]] = []

    def _rng_saved(self):
        return self.generator.get_state() if self.generator is not None else None

    def _rng_restore(self, state) -> None:
        if state is not None:
            self.generator.set_state(state)

    def capture(self) -> None:
        """Capture (or emulate) ``fn`` on the static inputs. Every kernel it runs here only repeats
        the round it is about to replay (the halves are idempotent on the caches), and the random
        stream is rewound afterwards, so the replay draws what an eager round would."""
        rng = self._rng_saved()
        if self.emulate:
            reads = _ExternalReads()
            with reads:
                out = self.fn(*self.static_in)
            # An output that is an expanded view (stride 0: the decide half of a plan that decides
            # on layer 1 returns its frontier so) is one buffer in a real graph; the emulation
            # keeps a copy of its own to copy each replay's result into.
            self.static_out = [t.clone() if t is not None and 0 in t.stride() and t.numel() > 1 else t
                               for t in out]
            self.external = reads.read
            self._rng_restore(rng)
            return
        # Warm-up on a side stream (lazy library state is created outside the capture).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(*self.static_in)
        torch.cuda.current_stream().wait_stream(side)
        self._rng_restore(rng)
        graph = torch.cuda.CUDAGraph()
        if self.generator is not None and self.generator is not torch.cuda.default_generators[
                self.generator.device.index or 0]:
            # the engine's seeded generator advances on every replay as it would eagerly
            graph.register_generator_state(self.generator)
        with torch.cuda.graph(graph):
            self.static_out = list(self.fn(*self.static_in))
        self.graph = graph

    def replay(self, inputs: Tensors) -> List[Optional[torch.Tensor]]:
        for dst, src in zip(self.static_in, inputs):
            if dst is not None:
                _load(dst, src)
        if self.emulate:
            freed = [shape for ref, shape in self.external.values() if ref.expired()]
            if freed:
                raise RuntimeError(f"a replayed round half reads {len(freed)} tensor(s) freed since its capture "
                                   f"(shapes {freed[:4]}): a CUDA graph would read or write freed memory; keep "
                                   "them alive for as long as the graph (RoundGraphs.run keep=..., or their owner)")
            reads = _ExternalReads()
            with reads:
                fresh = self.fn(*self.static_in)
            stray = [shape for ptr, (_, shape) in reads.read.items() if ptr not in self.external]
            if stray:
                raise RuntimeError(f"a replayed round half read {len(stray)} tensor(s) it did not read when it was "
                                   f"captured (shapes {stray[:4]}): a CUDA graph would read the captured ones; "
                                   "pass them as inputs")
            for out, new in zip(self.static_out, fresh):
                if out is not None:
                    out.copy_(new)
        else:
            self.graph.replay()
        return self.static_out


class RoundGraphs:
    """Captured round halves of one engine, by configuration key (see the module docstring)."""

    def __init__(self, device, *, emulate: bool = False, max_graphs: int = 32, capture_after: int = 1):
        device = torch.device(device)
        if not emulate and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the engine is on {device}")
        if max_graphs < 1 or capture_after < 0:
            raise ValueError(f"RoundGraphs: max_graphs must be >= 1 and capture_after >= 0, got "
                             f"{max_graphs}, {capture_after}")
        self.device, self.emulate = device, emulate
        self.max_graphs, self.capture_after = max_graphs, capture_after
        self._graphs: "collections.OrderedDict[Hashable, _CapturedHalf]" = collections.OrderedDict()
        self._seen: collections.Counter = collections.Counter()
        self._uncapturable = set()
        self._storage = None
        # what happened, for reports and tests: eager runs, captures, replays, graphs dropped
        self.counts = collections.Counter()

    def bind_storage(self, *tensors: Optional[torch.Tensor]) -> bool:
        """Name the tensors the halves update in place (the KV caches). When they are not the ones
        the kept graphs were captured with (a new batch, a compacted one), every graph is dropped.
        Returns whether that happened (then buffers kept alive for the old graphs may go)."""
        # None: a tensor this call does not update (autoregressive decoding has no draft cache),
        # so no graph captured in it reads it either: it neither drops the graphs nor forgets the
        # one the others were captured with.
        # (pointer, shape, weak reference): a tensor freed since (the rows kept after an earlier
        # call's finished requests) is a change even when a new one lands at its address.
        storage = tuple(None if t is None else (t.data_ptr(), tuple(t.shape), StorageWeakRef(t.untyped_storage()))
                        for t in tensors)
        old = self._storage
        if old is not None and len(old) == len(storage):
            if all(n is None or o is None or (n[:2] == o[:2] and not o[2].expired()) for n, o in zip(storage, old)):
                self._storage = tuple(o if n is None else n for n, o in zip(storage, old))
                return False
        if self._graphs:
            self.counts["dropped"] += len(self._graphs)
        self._graphs.clear()
        self._seen.clear()
        self._uncapturable.clear()
        self._storage = storage
        return True

    def run(self, key: Hashable, fn: Callable[..., List[Optional[torch.Tensor]]], inputs: Tensors, *,
            shapes: Optional[Sequence[Optional[Sequence[int]]]] = None,
            generator: Optional[torch.Generator] = None, keep: tuple = ()) -> List[Optional[torch.Tensor]]:
        """``fn(*inputs)`` for configuration ``key``: eagerly the first ``capture_after`` times,
        then captured once and replayed. ``shapes`` (per input, optional): the static buffer's
        shape when an input may be narrower. ``keep``: objects the half reads that must outlive it.
        The key is extended by the inputs' (static) shapes and dtypes."""
        shapes = list(shapes) if shapes is not None else [None] * len(inputs)
        key = (key, tuple(None if t is None else (tuple(s if s is not None else t.shape), t.dtype)
                          for t, s in zip(inputs, shapes)))
        half = self._graphs.get(key)
        if half is None:
            self._seen[key] += 1
            if self._seen[key] <= self.capture_after:
                self.counts["eager"] += 1
                self.counts["first"] += 1
                return list(fn(*inputs))
            if key in self._uncapturable:
                self.counts["eager"] += 1
                return list(fn(*inputs))
            half = _CapturedHalf(fn, inputs, shapes, generator, self.emulate, keep)
            try:
                half.capture()
            except Exception as e:      # noqa: BLE001 - any capture error: this configuration stays eager
                if self.emulate:
                    raise
                self._uncapturable.add(key)
                self.counts["failed"] += 1
                warnings.warn(f"heterospec: a round half could not be captured as a CUDA graph and runs eagerly "
                              f"({type(e).__name__}: {e})", RuntimeWarning, stacklevel=3)
                self.counts["eager"] += 1
                return list(fn(*inputs))
            self.counts["captured"] += 1
            self._graphs[key] = half
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
                self.counts["dropped"] += 1
        self._graphs.move_to_end(key)
        self.counts["replayed"] += 1
        return half.replay(inputs)

    def one_offs(self) -> int:
        """Calls so far that ran a configuration's first eager run or its capture: a round that
        made one is not a sample of what its configuration costs (a capture took 0.1-8 s on an
        H200), so the engine does not time it (the policy's time corrections would learn it)."""
        return self.counts["first"] + self.counts["captured"] + self.counts["failed"]

    def __len__(self) -> int:
        return len(self._graphs)
