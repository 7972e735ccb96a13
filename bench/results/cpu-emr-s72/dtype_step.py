"""Our engine's one-token step, float32 vs bfloat16 target: tokens/s of autoregressive decoding and
where a bfloat16 step's time goes (torch profiler)."""
import time, sys, torch, heterospec
torch.set_num_threads(2)
res = {}
engines = {dt: heterospec.Engine.from_pretrained(dtype=getattr(torch, dt)) for dt in ("float32", "bfloat16")}
prompt = "Explain how a bicycle stays upright while moving, in a few paragraphs."
for dt, e in engines.items():
    e.generate(prompt, max_new_tokens=16, method="autoregressive")
for rep in range(3):
    for dt, e in engines.items():
        t0 = time.perf_counter(); r = e.generate(prompt, max_new_tokens=96, method="autoregressive")
        res.setdefault(dt, []).append(len(r.token_ids) / (time.perf_counter() - t0))
for dt, v in res.items():
    print(dt, "AR tok/s", [round(x, 1) for x in v])
if "--prof" in sys.argv:
    from torch.profiler import profile, ProfilerActivity
    for dt in ("float32", "bfloat16"):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            engines[dt].generate(prompt, max_new_tokens=32, method="autoregressive")
        print("==", dt)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
