"""GPU latency: tree verification on a Llama-3.1-8B-shaped target, and the engine's per-step split.

    python bench/gpu_latency.py                       # on the GPU host: everything below, ~1-2 min
    python bench/gpu_latency.py --cpu-smoke           # tiny shapes on CPU (< 5 s): exercises the code
    python -m pytest bench/gpu_latency.py --benchmark-only -s     # pytest-benchmark (CUDA only)

1. Verification latency. Our TargetModel with Llama-3.1-8B shapes (hidden 4096, 32 layers, 32/8
   heads, intermediate 14336, vocab 128256, llama3 rope) and random bf16 weights, built directly
   on the GPU. One forward over a T-node tree (T = 1, 16, 32, 64, 128; logits and EAGLE-3 features
   for every node, as the engine verifies) after a context of 1k / 4k random KV rows, against one
   plain decode step (one token, no features: what autoregressive decoding runs). Per attention
   backend: "sdpa" and "flashinfer" timed eagerly (CUDA events, warm-up, median: includes the
   host work and syncs of today's code), and "graph" figures: the same forward captured in a CUDA
   graph and replayed (GPU time only; sdpa as is, FlashInfer through a CUDA-graph-mode wrapper
   planned outside the graph, the design of docs/gpu.md).
2. Per-step split of the engine (draft, verify, ops, Python) for HeteroSpec's four tree
   configurations (entropy bin forced), EAGLE-3 and the autoregressive step, on the 8B shape with a
   random EAGLE-3 draft (Eagle3Draft.for_target, 32k draft vocabulary) and on a SmolLM2-135M-
   shaped random pair (or, with --pair default, the real built-in pair). The split wraps each
   component with a device sync (so the parts add up); the unwrapped round time is reported too,
   and the round with its two halves replayed as CUDA graphs (heterospec.graphs, the CUDA default).

Random weights: latencies are representative, acceptance is not (a random draft is rejected
almost always), so every round here verifies a full tree and commits one token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import heterospec  # noqa: E402
from heterospec import ops  # noqa: E402
from heterospec._checks import sync_free  # noqa: E402
from heterospec.config import OFFICIAL, SamplingParams, SpecConfig  # noqa: E402
from heterospec.entropy import EntropyBins  # noqa: E402
from heterospec.models.attention import GraphFlashInfer, flashinfer_available  # noqa: E402
from heterospec.models.target import TargetConfig, TargetModel  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SHAPES = {
    "llama3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False,
                        bos_token_id=128000, eos_token_id=128009),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
                 rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 64}, tie_word_embeddings=False,
                 bos_token_id=1, eos_token_id=2),
}
DRAFT_VOCAB = {"llama3.1-8b": 32000, "smollm2-135m": 8192, "tiny": 128}
SMOKE_CONFIG = SpecConfig(top_k=3, depth=2, total_tokens=8)   # --cpu-smoke only
NUM_BINS = 8


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def random_target(shape: str, device="cuda", dtype=torch.bfloat16, attn_backend="sdpa", seed=0) -> TargetModel:
    """Our TargetModel with `shape`'s config and N(0, 0.02) weights, allocated on `device` directly."""
    from transformers import LlamaConfig

    config = TargetConfig.from_hf(LlamaConfig(**SHAPES[shape]))
    with torch.device("meta"):
        shell = TargetModel(config, attn_backend)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, t in shell.state_dict().items():
        x = torch.empty(t.shape, dtype=dtype, device=device)
        tensors[name] = x.fill_(1.0) if name.endswith("norm.weight") else x.normal_(0.0, 0.02, generator=gen)
    del shell
    return TargetModel._build(config, tensors, dtype, torch.device(device), attn_backend, f"random {shape}")


def random_engine(target: TargetModel, shape: str, config: SpecConfig = OFFICIAL):
    draft = heterospec.Eagle3Draft.for_target(target, draft_vocab_size=DRAFT_VOCAB[shape], dtype=target.dtype)
    return heterospec.Engine(target, draft, config=config, bins=EntropyBins.fallback(config))


def default_engine(device="cuda", dtype=torch.bfloat16):
    return heterospec.Engine.from_pretrained(device=device, dtype=dtype, config=OFFICIAL)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def time_eager(fn, dev: torch.device, reps: int, warmup: int) -> float:
    """Median milliseconds of fn() (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    samples = []
    for _ in range(reps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(samples)


def time_graph(fn, dev: torch.device, reps: int) -> float:
    """Median milliseconds of one replay of fn() captured in a CUDA graph (GPU time only)."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return time_eager(graph.replay, dev, reps, warmup=2)
    finally:
        del graph


def _use_backend(model: TargetModel, backend) -> None:
    model.attn_backend_name, model._backend = backend.name, backend
    model._backend_key = (backend.name, model.device, model.dtype)


def _tree(T: int, dev, gen):
    """A random tree of T nodes (node i's parent is one of nodes (i-1)//2 .. i-1: deep and bushy)."""
    parents = [-1] + [int(torch.randint(max(0, (i - 1) // 2), i, (1,), generator=gen)) for i in range(1, T)]
    return torch.tensor([parents], device=dev), torch.tensor([T], device=dev)


def verify_latency(model: TargetModel, contexts=(1024, 4096), sizes=(1, 16, 32, 64, 128),
                   backends=("sdpa", "flashinfer"), reps=20, warmup=5, graphs=True) -> list:
    """Rows {backend, mode, context, T, ms, x_decode}; T = 0 is the one-token decode step."""
    with torch.inference_mode():
        return _verify_latency(model, contexts, sizes, backends, reps, warmup, graphs)


def _verify_latency(model, contexts, sizes, backends, reps, warmup, graphs) -> list:
    dev, rows = model.device, []
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for C in contexts:
        cache = model.new_cache(1, C + max(sizes) + 1)
        cache.k.normal_()
        cache.v.normal_()   # random K/V rows stand in for a prefill of C tokens (latency only)
        prefix = torch.full((1,), C, dtype=torch.int64, device=dev)
        one = torch.randint(0, vocab, (1, 1), generator=gen).to(dev)
        trees = {}
        for T in sizes:
            parents, num = _tree(T, dev, gen)
            mask, pos, _, _ = ops.build_tree(parents, num, prefix)
            trees[T] = (torch.randint(0, vocab, (1, T), generator=gen).to(dev), pos, mask, num)

        def decode():
            return model(one, prefix[:, None], cache, prefix, None, None, return_features=False)

        def verify(T):
            toks, pos, mask, num = trees[T]
            return lambda: model(toks, pos, cache, prefix, mask, num, return_features=True)

        modes = []
        for b in backends:
            if b == "flashinfer" and not (dev.type == "cuda" and flashinfer_available()
                                          and model.dtype in (torch.float16, torch.bfloat16)):
                continue
            modes.append((b, "eager"))
            if graphs and dev.type == "cuda":
                modes.append((b, "graph"))
        for b, mode in modes:
            try:
                if b == "flashinfer" and mode == "graph":
                    _use_backend(model, GraphFlashInfer(dev, 1, max(sizes), C + max(sizes)))
                else:
                    model.set_attn_backend(b)
                timed = []
                for T, fn in [(0, decode)] + [(T, verify(T)) for T in sizes]:
                    # graph: time_graph's eager warm-up call plans this shape (FlashInfer), then captures
                    ms = time_graph(fn, dev, reps) if mode == "graph" else time_eager(fn, dev, reps, warmup)
                    timed.append((T, ms))
                base = timed[0][1]
                for T, ms in timed:
                    rows.append(dict(backend=b, mode=mode, context=C, T=T, ms=round(ms, 4),
                                     x_decode=round(ms / base, 3)))
            except Exception as exc:  # recorded, not raised: the other backends still get measured
                rows.append(dict(backend=b, mode=mode, context=C, error=f"{type(exc).__name__}: {exc}"[:300]))
            finally:
                model.set_attn_backend("sdpa")
        cache = None  # free this context's KV before the next one is allocated
    return rows


# ---------------------------------------------------------------------------------------------
# Per-step split
# ---------------------------------------------------------------------------------------------


class SplitTimer:
    """Wraps the engine's components with device syncs; nested calls count to the outermost."""

    def __init__(self, dev):
        self.dev, self.depth, self.totals = dev, 0, {"draft": 0.0, "verify": 0.0, "ops": 0.0}

    def wrap(self, kind, fn):
        def timed(*a, **kw):
            if self.depth:
                return fn(*a, **kw)
            _sync(self.dev)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                out = fn(*a, **kw)
                _sync(self.dev)
                return out
            finally:
                self.totals[kind] += time.perf_counter() - t0
                self.depth -= 1
        return timed

    @contextmanager
    def installed(self, engine):
        draft, target, saved = engine.draft, engine.target, []
        for obj, names, kind in ((draft, ("extend", "tree_step", "logits", "to_target_ids"), "draft"),
                                 (target, ("forward",), "verify"), (ops, ops.OP_NAMES, "ops")):
            for n in names:
                saved.append((obj, n, obj.__dict__.get(n)))
                setattr(obj, n, self.wrap(kind, getattr(obj, n)))
        try:
            yield self
        finally:
            for obj, n, old in saved:
                if old is None:
                    delattr(obj, n)
                else:
                    setattr(obj, n, old)


def forced_bins(i: int) -> EntropyBins:
    """Eight bins whose edges put every finite path entropy into bin i."""
    return EntropyBins([-1e9 + j for j in range(i)] + [1e9 + j for j in range(NUM_BINS - 1 - i)])


def step_split(engine, prompt, rounds=10, warmup=2, configs=None) -> list:
    """Rows {config, depth, nodes, round_ms, draft_ms, verify_ms, ops_ms, python_ms, python_frac}."""
    dev, cfg, params = engine.device, engine.config, SamplingParams()
    engine.target.config.eos_token_ids = ()      # random models must not stop early
    extra, nodes = cfg.bin_actions(NUM_BINS)
    if configs is None:
        configs = [("heterospec", i) for i in range(cfg.aggressive_bins + 1)] + [("eagle3", -1), ("autoregressive", -1)]
    rows = []
    for method, b in configs:
        engine.bins = forced_bins(b if b >= 0 else NUM_BINS - 1)
        pol = engine._policy(method, cfg, "paper")          # forced bins: the paper's per-bin actions
        policy = pol.plan(1) if pol is not None else None
        n_tok = 2 * (rounds + warmup) * (policy.max_nodes + 2 if policy else 1) + 8
        with torch.inference_mode():
            st = engine._prefill([prompt], method, params, None, len(prompt) + n_tok, n_tok, None)

            def one_round():
                if policy is None:
                    engine._decode_one(st, params, n_tok, None)
                    return
                tree = engine._draft_tree(st, cfg, policy)
                verdict = engine._verify(st, tree, policy, params)
                engine._commit(st, tree, verdict, n_tok, None, 0.0, 0.0)

            for _ in range(warmup):
                one_round()
            _sync(dev)
            plain = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                one_round()
                _sync(dev)
                plain.append(time.perf_counter() - t0)
            timer = SplitTimer(dev)
            t0 = time.perf_counter()
            with timer.installed(engine):
                for _ in range(rounds):
                    one_round()
            _sync(dev)
            total = (time.perf_counter() - t0) / rounds
            # The same rounds replayed as CUDA graphs (heterospec.graphs; the engine's CUDA default),
            # and for a FlashInfer target also with its split attention in the replays.
            graphed, graphed_split, graph_busy = [], [], None
            if engine.round_graphs is not None and engine.static_rounds:
                def graph_round():
                    if policy is None:                   # plain steps replay their own graph
                        engine._decode_one(st, params, n_tok, None)
                        return
                    with sync_free():
                        tree = engine._draft_half(st, cfg, policy)
                        verdict = engine._verify_half(st, tree, policy, params)
                    engine._commit(st, tree, verdict, n_tok, None, 0.0, 0.0)

                def timed(out):
                    for _ in range(warmup + 1):          # eager once, then capture
                        graph_round()
                    _sync(dev)
                    for _ in range(rounds):
                        t0 = time.perf_counter()
                        graph_round()
                        _sync(dev)
                        out.append(time.perf_counter() - t0)

                timed(graphed)
                graph_busy = device_busy_ms(graph_round, rounds, dev)
                if engine.target.backend.name == "flashinfer":
                    engine.graph_attention = "split"
                    try:
                        timed(graphed_split)
                    finally:
                        engine.graph_attention = "sdpa"
        parts = {k: 1e3 * v / rounds for k, v in timer.totals.items()}
        python = max(0.0, 1e3 * total - sum(parts.values()))
        recs = st.stats[0].records[-rounds:]
        depth = recs[-1].depth if recs else 0
        verified = recs[-1].verified if recs else 1
        name = f"{method} bin {b}" if method == "heterospec" else method
        rows.append(dict(config=name, depth=depth, nodes=verified, round_ms=round(1e3 * statistics.median(plain), 3),
                         split_total_ms=round(1e3 * total, 3), draft_ms=round(parts["draft"], 3),
                         verify_ms=round(parts["verify"], 3), ops_ms=round(parts["ops"], 3),
                         python_ms=round(python, 3), python_frac=round(python / (1e3 * total), 3),
                         graph_round_ms=round(1e3 * statistics.median(graphed), 3) if graphed else None,
                         graph_split_round_ms=round(1e3 * statistics.median(graphed_split), 3)
                         if graphed_split else None,
                         graph_device_ms=graph_busy,
                         # the issue's "host overhead with graphs on": the part of a replayed round
                         # (synced after it, as the engine's one host read does) the GPU is idle
                         graph_host_frac=round(max(0.0, 1.0 - graph_busy / (1e3 * statistics.median(graphed))), 3)
                         if graphed and graph_busy else None))
    return rows


def device_busy_ms(fn, calls: int, dev) -> float | None:
    """Kernel time per call of ``fn`` on the GPU (torch.profiler, CUDA activity; kernels inside
    CUDA graph replays included), or None off CUDA or when the profiler saw no kernels."""
    if dev.type != "cuda":
        return None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _sync(dev)
    us = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
             for e in prof.key_averages())
    return round(us / 1e3 / calls, 3) if us > 0 else None


def plain_anatomy(engine, prompt, steps=20, warmup=3) -> dict:
    """Where a plain (autoregressive) step's time goes, per graph attention of a FlashInfer
    target ("sdpa" and "split"; one mode otherwise): the host's time to issue the step
    (``Engine._plain_step``), the device's time for it (CUDA events around it), the whole step with
    its one host read (``Engine._decode_one``), and the top kernels of the steps (torch.profiler).
    On an H200 a replayed step of the 135M pair took 5.1 ms (second GPU run): this says why."""
    dev, params = engine.device, SamplingParams()
    engine.target.config.eos_token_ids = ()
    modes = ["sdpa", "split"] if engine.target.backend.name == "flashinfer" else [engine.graph_attention]
    n_tok = 2 * (steps + warmup) + 16
    out = {}
    for mode in modes:
        engine.graph_attention = mode
        issue, device_ms = [], []
        inner = engine._plain_step

        def timed_plain_step(*a, **kw):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if dev.type == "cuda" else None
            if ev:
                ev[0].record()
            t0 = time.perf_counter()
            res = inner(*a, **kw)
            issue.append(time.perf_counter() - t0)
            if ev:
                ev[1].record()
                device_ms.append(ev)
            return res

        with torch.inference_mode():
            st = engine._prefill([prompt], "autoregressive", params, None, len(prompt) + n_tok, n_tok, None)
            for _ in range(warmup):
                engine._decode_one(st, params, n_tok, None)
            _sync(dev)
            engine._plain_step = timed_plain_step
            whole = []
            try:
                for _ in range(steps):
                    t0 = time.perf_counter()
                    engine._decode_one(st, params, n_tok, None)
                    whole.append(time.perf_counter() - t0)
                _sync(dev)
                acts = [torch.profiler.ProfilerActivity.CPU]
                if dev.type == "cuda":
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=acts) as prof:
                    for _ in range(min(steps, 10)):
                        engine._decode_one(st, params, n_tok, None)
                    _sync(dev)
            finally:
                del engine._plain_step          # back to the class's method
        sort = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
        out[mode] = {
            "issue_ms": round(1e3 * statistics.median(issue), 3),
            "device_ms": round(statistics.median(a.elapsed_time(b) for a, b in device_ms), 3) if device_ms else None,
            "step_ms": round(1e3 * statistics.median(whole), 3),
            "top": prof.key_averages().table(sort_by=sort, row_limit=12),
        }
    engine.graph_attention = "sdpa"
    return out


def anatomy_markdown(name: str, res: dict) -> str:
    out = [f"Plain step anatomy, {name} (ms, median):\n",
           "| graph attention | issue (host) | device (CUDA events) | whole step (with its host read) |",
           "|---|---:|---:|---:|"]
    for mode, r in res.items():
        d = "-" if r["device_ms"] is None else f"{r['device_ms']:.3f}"
        out.append(f"| {mode} | {r['issue_ms']:.3f} | {d} | {r['step_ms']:.3f} |")
    for mode, r in res.items():
        out.append(f"\nTop ops, {mode}:\n\n```\n{r['top']}\n```")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def machine(dev: torch.device) -> str:
    from heterospec.bench import machine_description

    return f"{machine_description(dev)}; torch {torch.__version__}" + (
        f", CUDA {torch.version.cuda}" if dev.type == "cuda" else "")


def latency_markdown(rows) -> str:
    out = ["| backend | mode | context | T | ms | x one-token decode |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['backend']} | {r['mode']} | {r['context']} | - | error: {r['error'][:80]} | |")
        else:
            t = "decode (1)" if r["T"] == 0 else r["T"]
            out.append(f"| {r['backend']} | {r['mode']} | {r['context']} | {t} | {r['ms']:.3f} | {r['x_decode']:.2f} |")
    return "\n".join(out)


def split_markdown(rows) -> str:
    out = ["| config | tree layers | verified nodes | round ms (plain) | split total ms | draft | verify | ops "
           "| Python | Python % | round ms (CUDA graphs) | GPU busy ms (graphs) | host % (graphs) "
           "| round ms (graphs, FlashInfer split) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def ms(v):
        return "-" if v is None else f"{v:.2f}"

    def pct(v):
        return "-" if v is None else f"{100 * v:.0f}"

    for r in rows:
        out.append(f"| {r['config']} | {r['depth']} | {r['nodes']} | {r['round_ms']:.2f} | {r['split_total_ms']:.2f} | "
                   f"{r['draft_ms']:.2f} | {r['verify_ms']:.2f} | {r['ops_ms']:.2f} | {r['python_ms']:.2f} | "
                   f"{100 * r['python_frac']:.0f} | {ms(r.get('graph_round_ms'))} | {ms(r.get('graph_device_ms'))} | "
                   f"{pct(r.get('graph_host_frac'))} | {ms(r.get('graph_split_round_ms'))} |")
    return "\n".join(out)


def run(args) -> dict:
    smoke = args.cpu_smoke
    dev = torch.device("cpu" if smoke else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --cpu-smoke")
    dtype = torch.float32 if smoke else torch.bfloat16
    result = {"machine": machine(dev), "dtype": str(dtype), "weights": "random", "verify": [], "split": {},
              "anatomy": {}}
    big = "tiny" if smoke else "llama3.1-8b"
    small = "tiny" if smoke else "smollm2-135m"
    contexts = args.contexts or ([16] if smoke else [1024, 4096])
    sizes = args.sizes or ([1, 4] if smoke else [1, 16, 32, 64, 128])
    reps, warmup = (1, 1) if smoke else (args.reps, 5)
    rounds, rwarm = (1, 0) if smoke else (args.rounds, 2)
    spec = SMOKE_CONFIG if smoke else OFFICIAL
    t0 = time.perf_counter()
    if args.pair == "random":
        target = random_target(big, dev, dtype)
        result["target"] = big
        if not args.split_only:
            result["verify"] = verify_latency(target, contexts, sizes, args.backends, reps, warmup, graphs=not smoke)
            print(latency_markdown(result["verify"]), flush=True)
        prompt = list(range(10, 10 + (32 if smoke else 1024)))
        target.set_attn_backend("auto")   # the engine's default: flashinfer when importable on CUDA
        result["split_backend"] = target.backend.name
        result["split"][f"{big} (random weights)"] = step_split(random_engine(target, big, spec), prompt, rounds, rwarm)
        del target
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if not smoke:
            small_target = random_target(small, dev, dtype, attn_backend="auto")
            small_engine = random_engine(small_target, small)
            result["split"][f"{small} (random weights)"] = step_split(small_engine, prompt[:256], rounds, rwarm)
            result["anatomy"][f"{small} (random weights)"] = plain_anatomy(small_engine, prompt[:256])
        else:
            result["anatomy"]["tiny (random weights)"] = plain_anatomy(
                random_engine(random_target(big, dev, dtype), big, spec), prompt[:16], steps=3, warmup=1)
    else:
        engine = default_engine(dev, dtype)
        result["split_backend"] = engine.target.backend.name
        tok = engine.tokenizer
        text = ("Explain, step by step, how a compiler turns source code into machine code, and give a short "
                "example in C with the assembly it produces.")
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True) if tok is not None else list(range(10, 266))
        if hasattr(prompt, "keys"):
            prompt = prompt["input_ids"]
        result["weights"] = "real (SmolLM2-135M-Instruct + shipped EAGLE-3 draft)"
        result["split"]["default pair (real weights)"] = step_split(engine, list(prompt), rounds, rwarm)
        result["anatomy"]["default pair (real weights)"] = plain_anatomy(engine, list(prompt))
    for name, rows in result["split"].items():
        print(f"\n{name}\n" + split_markdown(rows), flush=True)
    for name, res in result["anatomy"].items():
        print("\n" + anatomy_markdown(name, res), flush=True)
    result["config"] = spec.to_dict()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def to_markdown(result: dict) -> str:
    parts = [f"Machine: {result['machine']}; {result['dtype']}; weights: {result['weights']}; "
             f"engine attention backend: {result.get('split_backend')}"]
    if result["verify"]:
        parts.append(f"\nVerification latency, {result.get('target')} shape (median; CUDA events on GPU):\n\n"
                     + latency_markdown(result["verify"]))
    for name, rows in result["split"].items():
        c = result["config"]
        parts.append(f"\nPer-step split, {name}, top_k {c['top_k']}, depth {c['depth']}, total_tokens "
                     f"{c['total_tokens']} (ms per round; parts timed with a device sync around each):\n\n"
                     + split_markdown(rows))
    for name, res in result.get("anatomy", {}).items():
        parts.append("\n" + anatomy_markdown(name, res))
    return "\n".join(parts) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, a few iterations (< 5 s)")
    p.add_argument("--pair", choices=["random", "default"], default="random",
                   help="random: 8B-shaped verification + 8B / SmolLM2-shaped random pairs; default: the real pair")
    p.add_argument("--split-only", action="store_true", help="skip the verification-latency table")
    p.add_argument("--contexts", type=int, nargs="+")
    p.add_argument("--sizes", type=int, nargs="+")
    p.add_argument("--backends", nargs="+", default=["sdpa", "flashinfer"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--md", help="write the Markdown tables here")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    if args.cpu_smoke:   # tiny ops: one thread avoids OpenMP stalls on a shared CPU
        torch.set_num_threads(1)
    try:
        result = run(args)
    finally:
        torch.set_num_threads(threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(to_markdown(result))
    return 0


# ---------------------------------------------------------------------------------------------
# pytest / pytest-benchmark (CUDA only; the CPU smoke run is tests/test_gpu_tools.py)
# ---------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def target_8b():
    model = random_target("llama3.1-8b")
    yield model
    del model
    torch.cuda.empty_cache()


@needs_cuda
@pytest.mark.parametrize("backend", ["sdpa", "flashinfer"])
@pytest.mark.parametrize("context", [1024, 4096])
@pytest.mark.parametrize("T", [0, 1, 16, 32, 64, 128])
def test_verify_latency_8b(benchmark, target_8b, backend, context, T):
    if backend == "flashinfer" and not flashinfer_available():
        pytest.skip("flashinfer is not installed")
    m, dev = target_8b, target_8b.device
    m.set_attn_backend(backend)
    cache = m.new_cache(1, context + 129)
    prefix = torch.full((1,), context, dtype=torch.int64, device=dev)
    if T == 0:   # the one-token decode step
        args = (torch.zeros(1, 1, dtype=torch.int64, device=dev), prefix[:, None], cache, prefix, None, None)
        kw = dict(return_features=False)
    else:
        parents, num = _tree(T, dev, torch.Generator().manual_seed(0))
        mask, pos, _, _ = ops.build_tree(parents, num, prefix)
        args = (torch.zeros(1, T, dtype=torch.int64, device=dev), pos, cache, prefix, mask, num)
        kw = dict(return_features=True)

    def call():
        with torch.inference_mode():
            m(*args, **kw)
        torch.cuda.synchronize()

    benchmark.extra_info.update(device=torch.cuda.get_device_name(), backend=backend, context=context, T=T)
    benchmark.pedantic(call, rounds=20, iterations=1, warmup_rounds=3)
    m.set_attn_backend("sdpa")


@needs_cuda
def test_step_split_8b(benchmark, target_8b):
    rows = benchmark.pedantic(lambda: step_split(random_engine(target_8b, "llama3.1-8b"), list(range(10, 1034)), 5, 1,
                                                 configs=[("heterospec", 0), ("eagle3", -1)]), rounds=1, iterations=1)
    benchmark.extra_info["split"] = rows
    print("\n" + split_markdown(rows))
    assert all(r["round_ms"] > 0 for r in rows)


if __name__ == "__main__":
    sys.exit(main())
