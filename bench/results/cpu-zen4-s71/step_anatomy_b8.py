"""Where a vLLM + HeteroSpec step's time goes at batch 8 served continuously (32 prompts in one call, 8 running)."""
import collections, json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

T = collections.defaultdict(float); N = collections.Counter()

import cProfile, pstats
PROF = cProfile.Profile()
def profiled(cls, name):
    f = getattr(cls, name)
    def w(*a, **k):
        PROF.enable()
        try:
            return f(*a, **k)
        finally:
            PROF.disable()
    setattr(cls, name, w)

def timed(cls, name, label=None):
    f = getattr(cls, name)
    label = label or f"{cls.__name__}.{name}"
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T[label] += time.perf_counter() - t; N[label] += 1
    setattr(cls, name, w)

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.v1.spec_decode import llm_base_proposer as lbp
    from vllm.model_executor.models import llama_eagle3 as le3
    from heterospec.vllm_plugin import proposer as hp
    from heterospec.vllm_plugin.__main__ import _paths, default_memory_fraction
    B = lbp.SpecDecodeBaseProposer
    for n in ("set_inputs_first_pass", "build_per_group_and_layer_attn_metadata", "_update_positions_dependent_metadata",
              "build_model_inputs_first_pass", "_determine_batch_execution_and_padding", "prepare_next_token_ids_padded",
              "prepare_inputs_padded"):
        timed(B, n)
    timed(hp.HeteroSpecProposer, "propose", "HS.propose")
    timed(hp.HeteroSpecProposer, "_sample_draft_tokens", "HS._sample_draft_tokens")
    timed(le3.Eagle3LlamaForCausalLM, "forward", "draft.forward")
    timed(le3.Eagle3LlamaForCausalLM, "combine_hidden_states", "draft.combine_hidden_states")
    timed(hp.HeteroSpecProposer, "_greedy_tokens", "HS._greedy_tokens")
    timed(hp.HeteroSpecProposer, "_draft_logits", "HS._draft_logits")
    timed(hp.HeteroSpecProposer, "_decide", "HS._decide")
    timed(hp.HeteroSpecProposer, "_greedy_logits", "HS._greedy_logits")
    from heterospec.vllm_plugin import pathstop as ps
    timed(ps.PathStop, "step", "PathStop.step")
    timed(hp.HeteroSpecProposer, "_start_path", "HS._start_path")
    for n in ("_trace_step", "_explore_plan", "_refresh", "_save_costs", "_observe_step", "_feed_lookup", "_lookup_choice", "_plan", "_lookup_step", "_first_forward_only", "_keep_warm"):
        timed(hp.HeteroSpecProposer, n, "HS." + n)
    timed(ps.ConfidenceCalibration, "observe", "Calibration.observe")
    timed(ps.LookaheadCalibration, "observe", "Lookahead.observe")
    from heterospec import sampling as hsamp
    _te = hp.ops.topk_entropy
    class _O: pass
    def te(*a, **k):
        t = time.perf_counter()
        try: return _te(*a, **k)
        finally: T["ops.topk_entropy"] += time.perf_counter() - t; N["ops.topk_entropy"] += 1
    hp.ops = type("M", (), {"__getattr__": lambda self, n: getattr(__import__("heterospec.ops", fromlist=["x"]), n), "topk_entropy": staticmethod(te)})()
    _gt = hp.greedy_tokens
    def gt(*a):
        t = time.perf_counter()
        try: return _gt(*a)
        finally: T["greedy_tokens"] += time.perf_counter() - t; N["greedy_tokens"] += 1
    hp.greedy_tokens = gt
    from vllm.v1.worker import gpu_model_runner as gmr
    timed(gmr.GPUModelRunner, "execute_model", "runner.execute_model")
    timed(gmr.GPUModelRunner, "sample_tokens", "runner.sample_tokens")
    timed(gmr.GPUModelRunner, "_model_forward", "runner._model_forward")
    for n in os.environ.get("PROFILE", "").split():
        if n.startswith("runner."):
            profiled(gmr.GPUModelRunner, n[len("runner."):])
        else:
            profiled(hp.HeteroSpecProposer, n)
    METHOD = os.environ.get("METHOD", "hs")     # hs, ar, k1, k2, ...
    p = _paths()
    prompts = json.load(open(sys.argv[1]))[:32]
    opts = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    llm = LLM(model=p["target"], dtype="float32", max_model_len=2048, max_num_seqs=8, enforce_eager=True, seed=0,
              distributed_executor_backend="uni", gpu_memory_utilization=default_memory_fraction(),
              speculative_config=None if METHOD == "ar" else {"method": "eagle3", "model": p["draft"], "num_speculative_tokens": 6 if METHOD == "hs" else int(METHOD[1:])},
              additional_config={"heterospec": opts} if METHOD == "hs" else {}, async_scheduling=False)
    msgs = [[{"role": "user", "content": q}] for q in prompts]
    llm.chat(msgs[:1], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    T.clear(); N.clear(); PROF = cProfile.Profile(); globals()["PROF"] = PROF
    t0 = time.perf_counter(); toks = 0
    for _ in range(int(os.environ.get("PASSES", "2"))):
        o = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=128), use_tqdm=False)
        toks += sum(len(x.outputs[0].token_ids) for x in o)
    dt = time.perf_counter() - t0
    print(f"tokens {toks} seconds {dt:.2f} tok/s {toks/dt:.1f}")
    for k in sorted(T, key=lambda k: -T[k]):
        print(f"{k:50s} calls {N[k]:6d} total {T[k]*1e3:9.1f} ms  per call {T[k]/N[k]*1e3:7.3f} ms")
    if os.environ.get("PROFILE"):
        pstats.Stats(PROF).sort_stats("tottime").print_stats(30)
