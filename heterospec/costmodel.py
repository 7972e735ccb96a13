"""What a round costs on this device: the cost model behind the fitted HeteroSpec policy.

Measured by running the engine's own round phases (so every overhead is in), in milliseconds,
for one model pair on one device:

    target_ms(T, context)        one target forward over T tokens (tree tokens of the whole batch,
                                 features on) after ``context`` cached tokens: the shape of the
                                 verify cost in tokens and context
    plain_ms(B, context)         one plain decoding step of B requests (the engine's _decode_one)
    draft_ms(B, d, n)            the engine's _draft_tree for B requests: extend over n new tokens
                                 per request, then d tree forwards (linear in d and n, per B)
    verify_ms(B, N, context)     the rest of a round (_verify + _commit: node selection, tree
                                 build, the target forward over N nodes per request, acceptance,
                                 KV compaction, bookkeeping), per B and N

A model is saved with the *fingerprint* of where it was measured (CPU model and ISA flags or GPU
name, threads, the MKL / oneDNN ISA caps, torch version, dtypes, model shapes, a hash of the ops'
library: a rebuilt or upgraded kernel times differently). The engine looks
for the file of its own fingerprint in the user cache (``~/.cache/heterospec/costs``); a file
measured elsewhere is reported and not used. With none, the engine measures a quick one (a few
seconds: batch 1 only, larger batches scaled by the target's token curve) and caches it;
``heterospec costs`` measures the full model.

The curves time each phase on its own; the engine runs them one after another, at its prompts'
contexts, with its bookkeeping between. ``heterospec costs --in-use`` therefore can also time the engine's own
rounds (:func:`measure_in_use`: a speculative round and a plain step per batch size) against the
curves, and their ratios (:attr:`CostModel.in_use`) price every phase, so that a fresh process's
first rounds are chosen with a model the engine's rounds agree with. Opt-in (``--in-use measure``,
or ``only`` on a saved model): tried on the built-in pair it paid at batch 8-16 and lost at 1-2
(bench/RESULTS.md, forty-ninth session), so ``heterospec costs`` leaves it out by default.

A model measured beside other work prices every phase too high and bends its curves (seen: 12
verified nodes priced below 8, and the fitted policy verifying 12). So a measurement records how
many cores other processes kept busy meanwhile (``/proc/stat``), and every curve is kept
non-decreasing in tokens and nodes; a quick model measured on a busy machine, or one whose use
found it far off (the fitted policy's online time corrections outside ``TRUSTED_SCALE``), is
measured again at the next start. A full model is reported instead.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import statistics
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from ._ext import kernels_id
from .models.linear import settled_weights

COSTS_DIR = "costs"
FORMAT = 2          # 2: the draft rows' fourth number, the long extend slope (EXTEND_LONG)
ISA_ENV = ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "HETEROSPEC_CPU_SCALAR")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")


# ---------------------------------------------------------------------------------------------
# Fingerprint
# ---------------------------------------------------------------------------------------------
def _cpu_info() -> dict:
    model, flags = "unknown", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    have = set(line.split(":", 1)[1].split())
                    flags = [fl for fl in CPU_FLAGS if fl in have]
    except OSError:
        pass
    return {"cpu": model, "cpu_flags": flags}


def isa_env() -> dict:
    """The environment variables that cap the instruction set (an emulated smaller CPU)."""
    return {k: os.environ[k] for k in ISA_ENV if os.environ.get(k)}


def fingerprint(engine) -> dict:
    """Where and for what a cost model is valid."""
    target, draft = engine.target, engine.draft
    dev = engine.device
    w = target.lm_head.weight
    fp = {"device": dev.type, "torch": torch.__version__.split("+")[0], "kernels": kernels_id(),
          "target_dtype": str(w.dtype).removeprefix("torch."),
          "draft_dtype": draft_form(draft) if draft is not None else None}
    if dev.type == "cuda":
        fp["gpu"] = torch.cuda.get_device_name(dev)
        fp["attention"] = target.backend.name
        fp["graphs"] = (getattr(engine, "graph_attention", None)
                        if getattr(engine, "round_graphs", None) is not None else None)
    else:
        fp.update(_cpu_info())
        fp["threads"] = torch.get_num_threads()
        fp["isa_env"] = isa_env()
        fp["linear"] = getattr(engine, "linear", "stock")
        if fp["linear"] == "tuned":
            from .models.linear import FORMAT as linear_format
            fp["linear_format"] = linear_format     # how the linears' paths were chosen
            from .models.linear import coded_formats
            codes = coded_formats([target, draft])
            if codes:                                 # weights streamed as block codes: other costs
                fp["linear_codes"] = codes
            from .models.target import STREAMED_LAYERS
            fp["layers"] = "streamed" if STREAMED_LAYERS else "modules"   # how the target's layers run
            if draft is not None:
                from .models.draft import STREAMED_DRAFT
                fp["draft_layers"] = "streamed" if STREAMED_DRAFT else "modules"   # ... and the draft's
    c = target.config
    fp["target"] = {"hidden": c.hidden_size, "layers": c.num_layers, "vocab": c.vocab_size,
                    "heads": c.num_heads, "kv_heads": c.num_kv_heads}
    if draft is not None:
        fp["draft"] = {"hidden": draft.config.hidden_size, "vocab": getattr(draft.config, "draft_vocab_size", None),
                       "intermediate": getattr(draft.config, "intermediate_size", None)}   # a wider MLP drafts slower
    return fp


def fingerprint_differences(have: dict, want: dict) -> List[str]:
    keys = sorted(set(have) | set(want))
    return [f"{k}: {have.get(k)!r} (file) vs {want.get(k)!r} (here)" for k in keys if have.get(k) != want.get(k)]


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation; linear extrapolation from the end segments."""
    if len(xs) == 1:
        return ys[0] * max(x, 1e-9) / max(xs[0], 1e-9)
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, 0.0)


def _lower_spikes(row: Sequence[float]) -> List[float]:
    """``row`` with every entry at most the ones after it (running minimum from the right)."""
    out = list(row)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
@dataclass
class CostModel:
    """Measured latency curves (see the module docstring) and where they were measured."""

    fingerprint: dict
    tokens: List[int]                          # T grid of the target curve
    contexts: List[int]                        # context grid of the target curve
    target: List[List[float]]                  # [context][T] ms
    batch_sizes: List[int]                     # B grid of the per-batch curves
    plain: List[float]                         # [B] ms (at contexts[0])
    draft: List[List[float]]                   # [B] (ms at d=0 n=1, ms per forward, ms per extend token up to
                                               # EXTEND_PROBE, and beyond it: EXTEND_LONG's slope)
    nodes: List[int]                           # N grid of the verify curve (root included)
    verify: List[List[float]]                  # [B][N] ms of _verify + _commit (at contexts[0])
    tree_top_k: int = 1                        # rows per request of a draft tree forward
    quick: bool = False
    provenance: dict = field(default_factory=dict)
    # The engine's own rounds timed against the curves (:func:`measure_in_use`): per batch size,
    # observed / predicted time of a speculative round ("round": draft and verify alike) and of
    # a plain step ("plain"); every price below carries its factor. Empty: the curves alone.
    in_use: dict = field(default_factory=dict)

    # Prices are pure functions of the fields, asked many times a round with the same arguments
    # (the lookup gate prices every prefix of a copied chain, the policy the draft's catch-up):
    # each is memoized, and setting any field clears the memo (no field is changed in place).
    MEMO_MAX = 4096

    def __setattr__(self, name, value) -> None:
        object.__setattr__(self, name, value)
        if name != "_memo":
            object.__setattr__(self, "_memo", {})

    def _memoized(self, key: tuple, compute: Callable[[], float]) -> float:
        memo = self._memo
        hit = memo.get(key)
        if hit is None:
            if len(memo) >= self.MEMO_MAX:
                memo.clear()
            hit = memo[key] = compute()
        return hit

    def __post_init__(self) -> None:
        # More tokens or more verified nodes never cost less: a spike (a descheduled run, another
        # process's minute) is lowered to the next size's, in every row, also in files measured
        # before this rule. A noisy verify row that priced 12 nodes below 8 made the fitted
        # policy verify 12 where 6 paid best (bench/RESULTS.md, the cost model measured on a busy box).
        self.target = [_lower_spikes(row) for row in self.target]
        self.verify = [_lower_spikes(row) for row in self.verify]

    @property
    def busy(self) -> float:
        """CPU cores other processes used on average while this model was measured (0 when
        unknown): a model measured beside other work prices everything as if it always ran."""
        return float(self.provenance.get("other_cores") or 0.0)

    @property
    def stamp(self) -> Optional[str]:
        """Which measurement this is (the online corrections kept beside the model correct this
        one): the curves' date, and the in-use factors' date where they were measured."""
        date = self.provenance.get("date")
        if not date:
            return None
        return str(date) + (f" in use {self.in_use['date']}" if self.in_use.get("date") else "")

    # -- predictions ------------------------------------------------------------------------------
    def target_ms(self, tokens: float, context: int = 256) -> float:
        return self._memoized(("target_ms", tokens, context), lambda: self._target_ms(tokens, context))

    def _target_ms(self, tokens: float, context: int = 256) -> float:
        per_ctx = [_interp(self.tokens, row, tokens) for row in self.target]
        # A longer context never costs less: a noisy lower value measured at a longer context
        # would extrapolate towards zero (every ratio to this curve with it).
        per_ctx = list(itertools.accumulate(per_ctx, max))
        return _interp(self.contexts, per_ctx, context) if len(self.contexts) > 1 else per_ctx[0]

    def _per_batch(self, values: Sequence[float], B: int, scale_rows: int) -> float:
        if len(self.batch_sizes) > 1:
            return _interp(self.batch_sizes, values, B)
        # Batch 1 only (a quick model): scale with the target's token curve at the same rows.
        b0 = self.batch_sizes[0]
        return values[0] * self.target_ms(B * scale_rows) / self.target_ms(b0 * scale_rows)

    def in_use_factor(self, kind: str, B: int) -> float:
        """The factor :attr:`in_use` measured for ``kind`` ("round" or "plain") at batch size
        ``B``: interpolated in log2(B) between the batch sizes it measured, the nearest one's
        outside them; 1 without a measurement."""
        sizes, factors = self.in_use.get("batch_sizes") or [], self.in_use.get(kind) or []
        if not sizes or len(sizes) != len(factors):
            return 1.0
        if B <= sizes[0]:
            return float(factors[0])
        if B >= sizes[-1]:
            return float(factors[-1])
        i = bisect_left(sizes, B)
        x0, x1, x = math.log2(sizes[i - 1]), math.log2(sizes[i]), math.log2(B)
        return float(factors[i - 1] + (factors[i] - factors[i - 1]) * (x - x0) / (x1 - x0))

    def plain_ms(self, B: int, context: int = 256) -> float:
        return self._memoized(("plain_ms", B, context), lambda: self._plain_ms(B, context))

    def _plain_ms(self, B: int, context: int = 256) -> float:
        base = self._per_batch(self.plain, B, 1)
        return base * self.target_ms(B, context) / self.target_ms(B, self.contexts[0]) * self.in_use_factor("plain", B)

    def draft_ms(self, B: int, forwards: float, extend_tokens: float = 1.0) -> float:
        return self._memoized(("draft_ms", B, forwards, extend_tokens), lambda: self._draft_ms(B, forwards, extend_tokens))

    def _draft_ms(self, B: int, forwards: float, extend_tokens: float = 1.0) -> float:
        a = self._per_batch([d[0] for d in self.draft], B, self.tree_top_k)
        b = self._per_batch([d[1] for d in self.draft], B, self.tree_top_k)
        c = self._per_batch([d[2] for d in self.draft], B, 1)
        extra = max(extend_tokens - 1.0, 0.0)
        short = min(extra, EXTEND_PROBE - 1.0)
        # Past EXTEND_PROBE tokens a token costs the long slope: a draft's linears turn from
        # reading their weights to computing, as the target's do (a row without it: the short one)
        c_long = self._per_batch([d[3] if len(d) > 3 else d[2] for d in self.draft], B, EXTEND_LONG) \
            if extra > short else 0.0
        return (a + b * forwards + c * short + c_long * (extra - short)) * self.in_use_factor("round", B)

    def verify_ms(self, B: int, nodes: float, context: int = 256) -> float:
        """The rest of a round of B requests verifying ``nodes`` nodes each (root included)."""
        return self._memoized(("verify_ms", B, nodes, context), lambda: self._verify_ms(B, nodes, context))

    def _verify_ms(self, B: int, nodes: float, context: int = 256) -> float:
        per_b = [_interp(self.nodes, row, nodes) for row in self.verify]
        base = self._per_batch(per_b, B, max(int(round(nodes)), 1))
        c0 = self.contexts[0]
        return base * self.target_ms(B * nodes, context) / self.target_ms(B * nodes, c0) * self.in_use_factor("round", B)

    # -- files ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d.pop("_memo", None)
        d["format"] = FORMAT
        return d

    def save(self, path: str) -> None:
        from ._io import write_json_atomic
        write_json_atomic(path, self.to_dict(), indent=1)

    @classmethod
    def load(cls, path: str) -> "CostModel":
        try:
            with open(path) as f:
                d = json.load(f)
            if d.pop("format", None) != FORMAT:
                raise ValueError(f"unknown format (expected {FORMAT})")
            return cls(**d)
        except FileNotFoundError:
            raise FileNotFoundError(f"cost model file not found: {path}") from None
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"cost model file {path} is not valid: {e}") from None


def cache_path(fp: dict) -> str:
    """The cached model of fingerprint ``fp``. The ops' library is left out of the key: a rebuilt
    or upgraded heterospec finds its predecessor's model (measured again by :func:`for_engine`),
    and the online state beside it keeps what it learnt about the draft's acceptance."""
    from .defaults import cache_root
    fp = {k: v for k, v in fp.items() if k != "kernels"}
    key = hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(str(cache_root()), COSTS_DIR, f"{fp['device']}-{fp['target_dtype']}-{key}.json")


def online_state_path(model_path: str, key: str = "*") -> str:
    """Where the fitted policy keeps its online corrections of the model at ``model_path`` for
    one draft and tree (``key``; ``"*"``: a glob pattern of all of them)."""
    return model_path.removesuffix(".json") + f".online-{key}.json"


def load_for(engine, path: Optional[str] = None) -> Optional[CostModel]:
    """The cost model for ``engine`` on this device: ``path`` if given and measured here, else the
    cached one of this fingerprint (possibly timed with another build of the ops: see
    :func:`for_engine`). A file measured elsewhere is reported (warning) and not used."""
    import warnings
    fp = fingerprint(engine)
    if path is not None:
        cm = CostModel.load(path)
        diff = fingerprint_differences(cm.fingerprint, fp)
        if not diff:
            return cm
        warnings.warn(f"cost model {path} was measured elsewhere and is not used here ({'; '.join(diff)}); "
                      "measure one on this device with `heterospec costs`", stacklevel=3)
        return None
    p = cache_path(fp)
    if os.path.exists(p):
        try:
            return CostModel.load(p)
        except ValueError:
            return None
    return None


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------
class OtherLoad:
    """How many CPU cores *other* processes kept busy between :meth:`start` and :meth:`cores`:
    the whole machine's busy time (``/proc/stat``) minus this process's CPU time, per second of
    wall time. None where ``/proc/stat`` cannot be read (not Linux)."""

    @staticmethod
    def _machine_busy_s() -> Optional[float]:
        try:
            with open("/proc/stat") as f:
                fields = [float(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError, IndexError):
            return None
        if len(fields) < 5:
            return None
        idle = fields[3] + fields[4]                      # idle + iowait
        return (sum(fields[:8]) - idle) / float(os.sysconf("SC_CLK_TCK"))

    @staticmethod
    def _own_cpu_s() -> float:
        t = os.times()
        return t.user + t.system

    @staticmethod
    def _wall_s() -> float:
        return time.perf_counter()

    def start(self) -> "OtherLoad":
        self._t0, self._busy0, self._own0 = self._wall_s(), self._machine_busy_s(), self._own_cpu_s()
        return self

    def cores(self) -> Optional[float]:
        busy = self._machine_busy_s()
        wall = self._wall_s() - self._t0
        if busy is None or self._busy0 is None or wall <= 0:
            return None
        return max(0.0, (busy - self._busy0) - (self._own_cpu_s() - self._own0)) / wall


#: Other processes using more than this many cores on average while a cost model was measured
#: make it "busy": reported, and a quick model measured so is measured again at the next start.
BUSY_CORES = 0.3


def _timer(dev):
    def now():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()
    return now


def _elementwise_min(a, b):
    if isinstance(a, list):
        return [_elementwise_min(x, y) for x, y in zip(a, b)]
    return min(a, b)


def measure(engine, quick: bool = True, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
            tokens: Optional[Sequence[int]] = None, contexts: Sequence[int] = (256, 768),
            repeats: Optional[int] = None, progress: bool = True,
            node_grid: Sequence[int] = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16), passes: int = 1) -> CostModel:
    """Measure the cost model of ``engine`` on its device (see the module docstring).

    ``quick``: batch 1, the first two contexts (the target's curve; the engine's phases at the
    first), a short token grid, 5 repeats (seconds on the built-in pair).
    ``passes``: the whole measurement this many times, every entry the fastest of its passes.
    Within a pass each entry is the fastest of ``repeats`` runs taken back to back, so a slow
    minute of a shared machine inflates the entries measured in it, and the curves' shapes with
    them (seen: a one-token step timed well above a two-token verify); a second pass minutes
    later takes most of that out.
    """
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"cost model: passes must be an integer >= 1, got {passes!r}")
    kw = dict(quick=quick, batch_sizes=batch_sizes, tokens=tokens, contexts=contexts, repeats=repeats,
              node_grid=node_grid)
    load = OtherLoad().start()
    cm = _measure_once(engine, progress=progress, desc="measuring round costs" +
                       (f" (pass 1/{passes})" if passes > 1 else ""), **kw)
    for i in range(1, passes):
        other = _measure_once(engine, progress=progress, desc=f"measuring round costs (pass {i + 1}/{passes})", **kw)
        for name in ("target", "plain", "draft", "verify"):
            setattr(cm, name, _elementwise_min(getattr(cm, name), getattr(other, name)))
        cm.__post_init__()                    # the merged curves' spikes lowered as well
    cm.provenance["passes"] = passes
    # CPU devices only: on a GPU the host's other work is not what distorts the times
    others = load.cores() if getattr(getattr(engine, "device", None), "type", None) == "cpu" else None
    if others is not None:
        cm.provenance["other_cores"] = round(others, 3)
        if others > BUSY_CORES:
            import warnings
            warnings.warn(f"other processes kept {others:.1f} CPU cores busy while this device's cost model was "
                          "measured: its times are too high and its curves distorted"
                          + (" (a quick model: measured again at the next start)" if quick else
                             "; measure again on a quiet machine (`heterospec costs`)"), stacklevel=2)
    return cm


def _measure_once(engine, quick: bool, batch_sizes: Sequence[int], tokens: Optional[Sequence[int]],
                  contexts: Sequence[int], repeats: Optional[int], progress: bool,
                  node_grid: Sequence[int], desc: str) -> CostModel:
    """One pass; with CUDA graphs it times the replayed halves, and if that fails (a path never
    run on this GPU) the eager ones, with a warning, rather than no model at all."""
    graphed = bool(getattr(engine, "static_rounds", False) and getattr(engine, "round_graphs", None) is not None)
    if graphed:
        try:
            return _measure_pass(engine, quick, batch_sizes, tokens, contexts, repeats, progress, node_grid, desc,
                                 graphed=True)
        except Exception as e:  # noqa: BLE001 - any failure of the graphed path: measure eagerly instead
            import warnings
            warnings.warn(f"heterospec: timing the replayed round halves failed ({type(e).__name__}: {e}); the "
                          "cost model times eager forwards instead", RuntimeWarning, stacklevel=3)
            graphs, engine.round_graphs = engine.round_graphs, None     # plain steps eager too
            try:
                return _measure_pass(engine, quick, batch_sizes, tokens, contexts, repeats, progress, node_grid,
                                     desc, graphed=False)
            finally:
                engine.round_graphs = graphs
    return _measure_pass(engine, quick, batch_sizes, tokens, contexts, repeats, progress, node_grid, desc,
                         graphed=False)


#: The extend length whose draft time, against one token's, prices each extra token the draft
#: extends over. The catch-ups it prices (after plain steps: up to twice Engine.draft_window
#: tokens) are that long; from 4 tokens, where a CPU draft's linears still cost what one token's
#: do, the slope read as nothing and the policy charged its catch-ups to its rounds' time
#: correction (bench/RESULTS.md, "A streamed draft with 8-bit weights").
EXTEND_PROBE = 16
#: The extend length that prices each token past EXTEND_PROBE: a call that started plain runs
#: the draft's pass over its prompts in its first drafted round, hundreds of rows, where each
#: costs ~4x the short slope on a CPU (compute, not weight reads); priced at the short slope, a
#: batch-4 prompt pass read as 4 ms where it took 37 (bench/RESULTS.md, sixty-fourth session).
#: Measured at the model's first context or this, whichever is shorter.
EXTEND_LONG = 128


def _measure_pass(engine, quick: bool, batch_sizes: Sequence[int], tokens: Optional[Sequence[int]],
                  contexts: Sequence[int], repeats: Optional[int], progress: bool,
                  node_grid: Sequence[int], desc: str, graphed: bool) -> CostModel:
    from tqdm.auto import tqdm

    from . import ops
    from .config import SamplingParams
    from .policy import Eagle3Policy, Plan

    if engine.draft is None:
        raise ValueError("cost model: the engine has no draft")
    dev, target = engine.device, engine.target
    now = _timer(dev)
    reps = repeats or (5 if quick else 7)
    # With CUDA graphs the engine replays its round halves and plain steps: time those (the
    # first timed run of each captures it, the fastest run is a replay), not eager forwards,
    # which a GPU runs launch-bound (an 8B-shaped verify: 24 ms eager, 7-11 ms replayed, H200).
    if graphed:
        reps = max(reps, 3)
    if quick:
        # (two contexts for the target's curve: the plain step's and a round's cost at a longer
        # context, which the guard scales its rounds by; one context made every context cost the
        # same, and a long-context request's plain steps set a short one's bar)
        tokens = tokens or (1, 2, 4, 8, 16, 32, 64)
        two = sorted(set(contexts))[:2]
        batch_sizes = (1,)
        contexts = tuple(c for c in two if c + max(tokens) + 1 <= engine.max_length) or (two[0],)
        node_grid = (1, 2, 3, 4, 6, 8, 12, 16)
    tokens = sorted(set(tokens or (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)))
    contexts, batch_sizes = sorted(set(contexts)), sorted(set(batch_sizes))
    limit = engine.max_length
    if max(contexts) + max(tokens) + 1 > limit:
        raise ValueError(f"cost model: context {max(contexts)} + {max(tokens)} tokens exceeds max_length {limit}")
    gen = torch.Generator(device="cpu").manual_seed(0)
    vocab = target.config.vocab_size
    k = engine.config.top_k
    node_grid = sorted(set(node_grid))
    # Every timed phase is registered first (``timed``: a closure that sets up its own state)
    # and run afterwards, one run of each per pass, ``reps`` passes, the fastest run kept: a
    # machine whose speed drifts during the measurement (a shared box, a neighbour's burst)
    # then shifts every phase alike instead of skewing the ratios the policy decides by
    # (measured one phase after another, a slow spell once priced a plain step above a
    # one-node verification, and the fitted policy verified 11 nodes where 5 paid).
    # (Interleaved per batch size only: with CUDA graphs, every switch between batches' caches
    # would drop the captured graphs.)
    jobs: List[Callable[[], object]] = []
    groups: List[int] = [0]          # where each batch size's phases start in ``jobs``

    def timed(fn) -> int:
        jobs.append(fn)
        return len(jobs) - 1

    with torch.inference_mode(), settled_weights():   # as in an engine call
        # 1. Target forward over T tokens after `context` cached tokens (one request: what
        #    matters for the linear layers is the token count, padded or ragged).
        target_rows = []
        for ctx in contexts:
            cache = target.new_cache(1, ctx + max(tokens) + 1)
            zero = torch.zeros(1, dtype=torch.int64, device=dev)
            prompt = torch.randint(0, vocab, (1, ctx), generator=gen).to(dev)
            target(prompt, torch.arange(ctx, device=dev)[None], cache, zero, None, None, return_features=False)
            prefix = torch.full((1,), ctx, dtype=torch.int64, device=dev)
            row = []
            for T in tokens:
                parents = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, T)]], device=dev)
                num = torch.tensor([T], device=dev)
                mask, pos, _, _ = ops.build_tree(parents, num, prefix)
                toks = torch.randint(0, vocab, (1, T), generator=gen).to(dev)
                row.append(timed(lambda toks=toks, pos=pos, mask=mask, num=num, cache=cache, prefix=prefix: target(
                    toks, pos, cache, prefix, mask, num, return_features=True, taps=engine._taps)))
            target_rows.append(row)          # spikes are lowered by CostModel itself

        # 2. Per batch size, the engine's own phases on B prompts of `ctx` tokens: a plain step,
        #    the draft tree at two depths and two extend lengths, and _verify + _commit for every
        #    N of the grid (on one drafted tree, the state restored before and after each).
        ctx = contexts[0]
        cfg = engine.config
        D = max(cfg.depth, 1)
        long_probe = min(EXTEND_LONG, ctx)
        grid = [n for n in node_grid if n - 1 <= k + 2 * k * k]
        params = SamplingParams()

        def phases(B: int):
            """Register batch size B's phases -> (plain, (draft d0, dD, n16, n128), [verify per N])."""
            if B != batch_sizes[0]:
                groups.append(len(jobs))     # the first batch size shares its group with part 1
            prompts = [torch.randint(0, vocab, (ctx,), generator=gen).tolist() for _ in range(B)]
            st = engine._prefill(prompts, "eagle3", params, None, ctx + 4 * (D + 2) * k + 2 * max(grid) + 64,
                                 10 ** 9, None, draft_prompt=False)   # the prompt's entries: pending extends
            feats0, toks0 = st.ext_feats, st.ext_tokens

            def saved():
                return (st.prefix_lens.clone(), st.root.clone(), [list(o) for o in st.outputs], list(st.finished),
                        st.ext_tokens, st.ext_feats, st.ext_num, st.draft_lens, st.target_cache)

            def restore(s):
                (st.prefix_lens, st.root, st.outputs, st.finished, st.ext_tokens, st.ext_feats, st.ext_num,
                 st.draft_lens, st.target_cache) = s

            def pending(n, room):
                """The draft's pending extend: the last ``n`` tokens, in arrays ``room`` wide."""
                st.ext_tokens, st.ext_feats = toks0[:, :room].clone(), feats0[:, :room].clone()
                st.ext_num = torch.full((B,), n, dtype=torch.int64, device=dev)
                st.draft_lens = st.prefix_lens - n

            # A plain step as the engine runs one between rounds: one token pending for the draft
            # (with room for more), not the whole prompt - growing a prompt-long pending extend
            # copies B x context features per step, which no steady-state step does.
            pending(1, 8)
            s0 = saved()

            def plain_step():
                restore(s0)
                engine._decode_one(st, params, 10 ** 9, None)
                restore(s0)

            def draft_at(depth, n):
                plan = Eagle3Policy(cfg.replace(depth=depth, total_tokens=max(grid))).plan(B)

                def run():
                    pending(n, n)
                    if graphed:
                        return engine._draft_half(st, cfg.replace(depth=depth), plan)
                    return engine._draft_tree(st, cfg.replace(depth=depth), plan)
                return run

            out = (timed(plain_step), (timed(draft_at(0, 1)), timed(draft_at(D, 1)), timed(draft_at(0, EXTEND_PROBE)),
                                       timed(draft_at(0, long_probe))))
            tree = draft_at(2, 1)()
            s1 = saved()

            def verify_at(n):
                plan = Plan("cost", decide_depth=2, entropy_k=k, edges=[], depth=[2], budget=[n - 1])

                def one():
                    restore(s1)
                    tree.budget = torch.full((B,), n - 1, dtype=torch.int64, device=dev)
                    if graphed:
                        verdict = engine._verify_half(st, tree, plan, params)
                    else:
                        verdict = engine._verify(st, tree, plan, params)
                    engine._commit(st, tree, verdict, 10 ** 9, None, 0.0, 0.0)
                    restore(s1)
                return one
            return out + ([timed(verify_at(n)) for n in grid],)

        plain, draft, verify = zip(*(phases(B) for B in batch_sizes))

        # 3. Run them, group by group: a warm-up pass (graphs captured), then the timed passes,
        #    each starting at another phase.
        best = [math.inf] * len(jobs)
        bar = tqdm(total=len(jobs) * (reps + 1), desc=desc, disable=not progress, unit="run")
        for lo, hi in zip(groups, groups[1:] + [len(jobs)]):
            group = list(range(lo, hi))
            for i in group:
                jobs[i]()
                bar.update()
            for r in range(reps):
                start = r * len(group) // reps
                for i in group[start:] + group[:start]:
                    t0 = now()
                    jobs[i]()
                    best[i] = min(best[i], 1e3 * (now() - t0))
                    bar.update()
        bar.close()
        target_rows = [[best[i] for i in row] for row in target_rows]
        plain = [best[i] for i in plain]
        draft = [[best[a], max(best[b] - best[a], 0.0) / D, max(best[c] - best[a], 0.0) / (EXTEND_PROBE - 1),
                  max(best[e] - best[c], 0.0) / (long_probe - EXTEND_PROBE) if long_probe > EXTEND_PROBE else
                  max(best[c] - best[a], 0.0) / (EXTEND_PROBE - 1)]
                 for a, b, c, e in draft]
        verify = [[best[i] for i in row] for row in verify]
    return CostModel(fingerprint=fingerprint(engine), tokens=list(tokens), contexts=list(contexts),
                     target=target_rows, batch_sizes=list(batch_sizes), plain=plain, draft=draft,
                     nodes=grid, verify=verify, tree_top_k=k, quick=quick,
                     provenance={"date": time.strftime("%Y-%m-%d %H:%M:%S"), "repeats": reps,
                                 "tree": {"top_k": cfg.top_k, "depth": cfg.depth,
                                          "total_tokens": cfg.total_tokens}})


#: An online time correction (observed / predicted step time, kept by the fitted policy next to
#: the model) outside this band says the model no longer describes the device.
TRUSTED_SCALE = (0.75, 1.33)


def contradicted_by_use(cm: CostModel, path: str) -> Optional[float]:
    """The first time correction outside ``TRUSTED_SCALE`` that the fitted policy learnt for
    this measurement of the model at ``path`` (its online states, ``<path>.online-*.json``) at a
    batch size the model measured, or None: the rounds of a real workload timed what the model
    predicts and found it that far off. Corrections at batch sizes it only extrapolates to (a
    quick model measures one request) are what the online corrections are for: measuring the
    model again would not move them, and was a quick model measured again in every process
    that decoded such a batch (bench/RESULTS.md, thirty-first session)."""
    import glob
    stamp = cm.stamp
    measured = {str(int(b)) for b in cm.batch_sizes}
    for f in sorted(glob.glob(online_state_path(glob.escape(path)))):
        try:
            with open(f) as fh:
                state = json.load(fh)
            if state.get("cost_model", stamp) != stamp:
                continue                          # learnt against an earlier measurement
            for key in ("plain_used", "time_used"):
                for bucket, v in state.get(key, {}).items():
                    if str(bucket) in measured and not TRUSTED_SCALE[0] <= float(v) <= TRUSTED_SCALE[1]:
                        return float(v)
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return None


def for_engine(engine, path: Optional[str] = None, progress: bool = True) -> CostModel:
    """The cost model the engine uses: ``path`` / the cached one if measured here, else a quick
    measurement (saved to the cache for next time)."""
    cm = load_for(engine, path)
    why = None
    if cm is not None and path is None:
        # A quick model (measured here automatically) that was timed with another build of the
        # ops, measured beside other work, or whose use found its times far off, is measured
        # again; a full one is the user's: reported.
        off = contradicted_by_use(cm, cache_path(cm.fingerprint))
        other_ops = cm.fingerprint.get("kernels") != kernels_id()
        why = ("was timed with another build of heterospec's ops" if other_ops else
               f"was measured while other processes kept {cm.busy:.1f} CPU cores busy" if cm.busy > BUSY_CORES else
               f"was found off in use (observed / predicted step time {off:.2f})" if off is not None else None)
        if why and not cm.quick:
            import warnings
            warnings.warn(f"this device's cost model {why}; measure it again on a quiet machine "
                          "(`heterospec costs`)", stacklevel=3)
            why = None
    if cm is not None and why is None:
        return cm
    if progress:
        print("heterospec: no cost model for this device yet; measuring a quick one "
              "(`heterospec costs` measures the full one)" if cm is None else
              f"heterospec: this device's quick cost model {why}; measuring it again", flush=True)
    cm = measure(engine, quick=True, progress=progress)
    try:
        cm.save(cache_path(cm.fingerprint))
    except OSError:
        pass
    return cm


# ---------------------------------------------------------------------------------------------
# The engine's own rounds against the curves
# ---------------------------------------------------------------------------------------------
#: measure_in_use: requests per batch size (batch 1: that many calls of one) and their tokens
IN_USE_REQUESTS = 4
IN_USE_TOKENS = 64
IN_USE_REPEATS = 3             # each batch size's calls this many times: the median ratio
IN_USE_MIN_ROUNDS = 8          # timed rounds a kind needs at a batch size for its factor
IN_USE_BAND = (0.5, 2.0)       # factors are kept within it (outside: the curves, not noise, are off)


def measure_in_use(engine, cm: CostModel, prompts: Sequence, batch_sizes: Optional[Sequence[int]] = None,
                   max_new_tokens: int = IN_USE_TOKENS, repeats: int = None, progress: bool = True) -> dict:
    """Time the engine's own rounds against ``cm`` and return its :attr:`CostModel.in_use`
    factors (also set on ``cm``, replacing any it had).

    The curves time each phase on its own: the target at a fixed context, after the curves'
    big forwards. The engine's rounds run at the prompts' contexts, one after another, with
    its bookkeeping between them, and a plain step was timed 1.3-1.4x what the engine's took
    (bench/RESULTS.md, forty-fifth and forty-sixth sessions) - an error every fresh process
    started from, until its online corrections had measured it, while its first rounds were
    chosen with it. So, at every batch size B of ``cm`` (or ``batch_sizes``), B of ``prompts``
    (different ones per call, ``IN_USE_REQUESTS`` requests in all) are decoded greedily twice:
    every round the fitted policy's speculative plan, then every round a plain step
    (:class:`heterospec.policy.ForcedPolicy`, no context lookup); per kind, the engine's timed
    rounds over what ``cm`` predicted for them is a ratio at B (none with fewer than
    ``IN_USE_MIN_ROUNDS`` rounds). All this ``repeats`` times (default ``IN_USE_REPEATS``), and
    the median ratio is the factor (kept within ``IN_USE_BAND``). The online corrections then start from
    a model the engine's own rounds agree with, and correct what the workload changes."""
    from tqdm.auto import tqdm
    from .policy import FittedPolicy, ForcedPolicy

    cfg = engine.config
    tables = engine.tables_for(cfg.top_k)
    if tables is None or tables.top_k != cfg.top_k or getattr(engine, "draft", None) is None:
        raise ValueError("measure_in_use needs a draft with acceptance tables for the engine's tree")
    texts = list(prompts)
    sizes = sorted({int(b) for b in (batch_sizes or cm.batch_sizes)})
    repeats = IN_USE_REPEATS if repeats is None else int(repeats)
    if not texts or not sizes or sizes[0] < 1 or repeats < 1:
        raise ValueError("measure_in_use needs prompts, batch sizes >= 1 and repeats >= 1")
    cm.in_use = {}
    calls = [(B, c) for B in sizes for c in range(max(1, IN_USE_REQUESTS // B))]

    def policies():
        return {kind: ForcedPolicy(tables, cm, cfg, speculate=kind == "round", ragged=engine.ragged_verify)
                for kind in ("round", "plain")}

    # one untimed call of each kind first: allocations, first-call dispatch
    for pol in policies().values():
        engine.generate_batch(texts[:1], max_new_tokens=8, method="heterospec", policy=pol, lookup=False)
    # Repeats, fresh policies each, and the median ratio: one disturbed minute of a shared
    # machine moved a single pass's factors to the band's edge (bench/RESULTS.md, 49th session).
    ratios = {(B, kind): [] for B in sizes for kind in ("round", "plain")}
    rounds = {(B, kind): 0.0 for B in sizes for kind in ("round", "plain")}
    bar = tqdm(total=repeats * len(calls), desc="timing the engine's rounds", disable=not progress, unit="call")
    at = 0
    for _ in range(repeats):
        forced = policies()
        for B, _c in calls:
            batch = [texts[(at + i) % len(texts)] for i in range(B)]
            at += B
            for pol in forced.values():
                engine.generate_batch(batch, max_new_tokens=max_new_tokens, method="heterospec", policy=pol,
                                      lookup=False)
            bar.update(1)
        for B in sizes:
            for kind in ("round", "plain"):
                obs, pred, n = forced[kind].time_sums(kind == "round").get(FittedPolicy.bucket(B), (0.0, 0.0, 0.0))
                if n >= IN_USE_MIN_ROUNDS and pred > 0 and obs > 0:
                    ratios[B, kind].append(obs / pred)
                    rounds[B, kind] += n
    bar.close()
    out = {"batch_sizes": [], "round": [], "plain": [], "rounds": [],
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "requests": IN_USE_REQUESTS,
           "max_new_tokens": int(max_new_tokens), "repeats": int(repeats)}
    for B in sizes:
        if not ratios[B, "round"] or not ratios[B, "plain"]:
            continue
        out["batch_sizes"].append(B)
        for kind in ("round", "plain"):
            f = float(statistics.median(ratios[B, kind]))
            out[kind].append(round(min(IN_USE_BAND[1], max(IN_USE_BAND[0], f)), 4))
        out["rounds"].append([round(rounds[B, "round"], 1), round(rounds[B, "plain"], 1)])
    cm.in_use = out if out["batch_sizes"] else {}
    return cm.in_use


# ---------------------------------------------------------------------------------------------
# The draft's dtype
# ---------------------------------------------------------------------------------------------
#: Another dtype must draft at least this much faster (time ratio) than the first candidate, the
#: preferred one, to be chosen: a draft's precision never changes the output, but within the
#: noise of a short timing the preferred dtype keeps its place.
DRAFT_DTYPE_MARGIN = 0.95
DRAFT_DTYPE_FORMAT = 1


def _dtype_name(dtype) -> str:
    """A candidate's name: a dtype's ("float32"), or a weight form as it is ("q8_0")."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def draft_form(draft) -> str:
    """How the draft's weights run: "q8_0" (float32, rounded to 8-bit codes), else its dtype."""
    dtype = next(draft.parameters()).dtype
    return "q8_0" if getattr(draft, "weight_form", None) == "q8_0" and dtype == torch.float32 else _dtype_name(dtype)


def to_draft_form(draft, form) -> None:
    """Convert ``draft`` in place to ``form``: a dtype, or "q8_0" (float32 weights rounded to
    their Q8_0 values; from a float32 or float16 file's exact values, not from bfloat16's)."""
    if form == "q8_0":
        draft.to(torch.float32)
        draft.round_weights_q8_0_()
    else:
        draft.to(form)


def draft_dtype_path(engine, candidates: Sequence[torch.dtype]) -> str:
    """Where the choice among ``candidates`` is cached: per machine (the cost model's
    fingerprint without the draft's dtype), candidates and tree."""
    from .defaults import cache_root
    fp = fingerprint(engine)
    fp.pop("draft_dtype", None)
    fp["candidates"] = [_dtype_name(d) for d in candidates]
    fp["tree"] = [engine.config.top_k, engine.config.depth]
    key = hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(str(cache_root()), COSTS_DIR, f"draft-dtype-{key}.json")


def _draft_copy(draft, dtype):
    """``draft`` in ``dtype`` (or the weight form "q8_0"), a new module (the target's embedding it shares stays shared; the
    reordered / packed weights of tuned linears and fused groups are not copied: the copy is
    tuned afresh)."""
    import copy
    memo = {id(m): m for m in getattr(draft, "_shared_embedding", [])}
    for mod in draft.modules():
        for name in ("_packed", "_stream", "_fused"):
            held = getattr(mod, name, None)
            if held is not None:
                memo[id(held)] = None
    out = copy.deepcopy(draft, memo=memo)
    to_draft_form(out, dtype)
    if hasattr(out, "release_tree_pools"):
        out.release_tree_pools()
    return out


def draft_round_ms(engine, drafts: Sequence, reps: int = 9, context: int = 128, progress: bool = True) -> List[float]:
    """The fastest of ``reps`` runs of the engine's draft half of one round (an extend over two
    committed tokens, then the tree's forwards, as :meth:`Engine._draft_tree` runs them for one
    request at the engine's tree) with each of ``drafts`` in turn; the runs interleave, so a
    machine whose speed drifts moves every draft alike. Leaves ``engine.draft`` as it found it."""
    from tqdm.auto import tqdm

    from .config import SamplingParams
    from .policy import Eagle3Policy

    cfg, dev, keep = engine.config, engine.device, engine.draft
    plan = Eagle3Policy(cfg).plan(1)
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompt = [torch.randint(0, engine.target.config.vocab_size, (context,), generator=gen).tolist()]
    now, jobs = _timer(dev), []
    try:
        with torch.inference_mode(), settled_weights():   # as in an engine call
            for draft in drafts:
                engine.draft = draft
                st = engine._prefill(prompt, "eagle3", SamplingParams(), None, context + 8 * (cfg.depth + 2) * cfg.top_k,
                                     10 ** 9, None, draft_prompt=False)
                toks, feats = st.ext_tokens, st.ext_feats

                def run(draft=draft, st=st, toks=toks, feats=feats):
                    engine.draft = draft
                    st.ext_tokens, st.ext_feats = toks[:, :2].clone(), feats[:, :2].clone()
                    st.ext_num = torch.full((1,), 2, dtype=torch.int64, device=dev)
                    st.draft_lens = st.prefix_lens - 2
                    engine._draft_tree(st, cfg, plan)
                jobs.append(run)
            best = [math.inf] * len(jobs)
            bar = tqdm(total=len(jobs) * (reps + 1), desc="timing the draft's dtypes", disable=not progress, unit="run")
            for job in jobs:
                job()                                   # warm-up
                bar.update()
            for r in range(reps):
                for i in list(range(len(jobs)))[r % len(jobs):] + list(range(len(jobs)))[:r % len(jobs)]:
                    t0 = now()
                    jobs[i]()
                    best[i] = min(best[i], 1e3 * (now() - t0))
                    bar.update()
            bar.close()
    finally:
        engine.draft = keep
    return best


def choose_draft_dtype(engine, candidates: Sequence[torch.dtype], reps: int = 9, progress: bool = True) -> dict:
    """Run ``engine``'s draft in the fastest of ``candidates`` (dtypes, or the weight form "q8_0":
    :func:`to_draft_form`) on this machine (the first, the
    preferred, unless another drafts a round in under :data:`DRAFT_DTYPE_MARGIN` of its time).
    The draft is expected in a dtype that holds every candidate's values exactly (float32 for a
    half-precision checkpoint): each candidate is converted from it. The choice is cached per
    machine (:func:`draft_dtype_path`) unless other processes kept the machine busy meanwhile.
    Returns a report: ``{"chosen", "ms": {dtype: ms}, "cached": bool, "busy_cores"}``."""
    from .models.linear import tune_linears

    candidates = list(dict.fromkeys(candidates))
    if not candidates:
        raise ValueError("choose_draft_dtype: no candidate dtypes")
    draft = engine.draft
    if draft is None:
        raise ValueError("choose_draft_dtype: the engine has no draft")
    path = draft_dtype_path(engine, candidates)
    names = [_dtype_name(d) for d in candidates]
    report = None
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved.get("format") == DRAFT_DTYPE_FORMAT and saved.get("chosen") in names:
            report = {**saved, "cached": True}
    except (OSError, ValueError, AttributeError):
        pass
    tuned = engine.linear == "tuned" and engine.device.type == "cpu"
    if report is None:
        drafts = [draft if _dtype_name(d) == draft_form(draft) else _draft_copy(draft, d) for d in candidates]
        if tuned:
            tune_linears(drafts[1:] if drafts[0] is draft else drafts)
        load = OtherLoad().start()
        ms = draft_round_ms(engine, drafts, reps=reps, progress=progress)
        busy = load.cores()
        first = ms[0]
        pick = min(range(len(ms)), key=lambda i: (ms[i], i))
        if ms[pick] >= DRAFT_DTYPE_MARGIN * first:
            pick = 0
        report = {"format": DRAFT_DTYPE_FORMAT, "chosen": names[pick], "ms": dict(zip(names, ms)),
                  "busy_cores": busy, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        if busy is None or busy <= BUSY_CORES:
            try:
                from ._io import write_json_atomic
                write_json_atomic(path, report, indent=1)
            except OSError:
                pass
        report = {**report, "cached": False}
        engine.draft = drafts[pick]
    else:
        chosen = candidates[names.index(report["chosen"])]
        if _dtype_name(chosen) != draft_form(draft):
            to_draft_form(draft, chosen)
            if tuned:
                tune_linears([draft])
    return report
