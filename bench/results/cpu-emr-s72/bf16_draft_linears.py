"""One draft linear at decode rows, bfloat16: vLLM's CPU GEMM dispatch vs our stream over the same
bfloat16 weight (draft shapes of the shipped EAGLE-3 draft). Median of interleaved reps."""
import time, statistics, torch
from vllm.model_executor.layers import utils
from heterospec.vllm_plugin.patch import _stream_copy, _streamed
torch.manual_seed(0)
shapes = {"fc": (576, 1728), "qkv": (960, 1152), "o": (576, 576), "gate_up": (3072, 1152 // 2 * 1), "down": (576, 1536), "lm_head": (8192, 576)}
shapes["gate_up"] = (3072, 576)
shapes["qkv"] = (960, 1152)   # EAGLE-3's first layer reads [embedding, hidden] = 2H
for rows in (1, 8):
    for name, (n, k) in shapes.items():
        lay = torch.nn.Linear(k, n, bias=False).bfloat16()
        utils.dispatch_cpu_unquantized_gemm(lay, remove_weight=False)
        ours = _streamed(*_stream_copy(lay), lambda x, w, b: None)
        x = torch.randn(rows, k).bfloat16()
        t = {"vllm": [], "ours": []}
        for _ in range(200):
            for lab, f in (("vllm", lambda: lay.cpu_linear(x, lay.weight, None)), ("ours", lambda: ours(x, lay.weight, None))):
                t0 = time.perf_counter(); f(); t[lab].append(time.perf_counter() - t0)
        v, o = statistics.median(t["vllm"]) * 1e3, statistics.median(t["ours"]) * 1e3
        print(f"rows {rows} {name:8s} {n}x{k}: vLLM {v:.3f} ms, ours {o:.3f} ms, ours/vLLM {o / v:.2f}")
