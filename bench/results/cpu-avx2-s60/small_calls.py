import torch, time
from heterospec import Engine
eng = Engine.from_pretrained()
tgt = eng.target
sl = tgt._build_stream_plans(1, torch.float32)
names = ["qkv", "o", "gate_up", "down"]
with torch.inference_mode():
    for th in (1, 2):
        torch.set_num_threads(th)
        for i, c in enumerate([sl[0].qkv[0], sl[0].o_proj, sl[0].gate_up[0], sl[0].down]):
            # all 30 layers' copies of this linear, cold
            cl = [[s.qkv[0], s.o_proj, s.gate_up[0], s.down][i] for s in sl]
            x = torch.randn(1, c.args[0].shape[1])
            best = 1e9
            for _ in range(10):
                t = time.perf_counter()
                for cc in cl: cc.op(x, *cc.args)
                best = min(best, time.perf_counter() - t)
            nb = sum(cc.args[0].numel() + cc.args[1].numel() * 4 for cc in cl)
            print("threads %d %-8s %6.1f us/call  %.1f GB/s  (%.0f KB/call)" % (th, names[i], best / 30 * 1e6, nb / best / 1e9, nb / 30 / 1e3))
