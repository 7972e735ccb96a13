import torch, time, sys
import heterospec
from torch.profiler import profile, ProfilerActivity
dt = getattr(torch, sys.argv[1])
eng = heterospec.Engine.from_pretrained(device="cpu", dtype=dt)
p = "Explain how a refrigerator works, in detail."
eng.generate(p, max_new_tokens=16, method="autoregressive")
t=time.perf_counter(); out = eng.generate(p, max_new_tokens=64, method="autoregressive"); el=time.perf_counter()-t
print(sys.argv[1], 'ms/token', 1e3*el/len(out.token_ids), 'verify ms/call', 1e3*out.stats.verify_s/max(1,out.stats.target_calls))
with profile(activities=[ProfilerActivity.CPU]) as prof:
    eng.generate(p, max_new_tokens=32, method="autoregressive")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
