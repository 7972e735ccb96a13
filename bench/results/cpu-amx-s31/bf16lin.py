import torch, torch.nn as nn
import heterospec.models.linear as L
torch.set_num_threads(2)
for (n, k) in [(960, 1152), (576, 576), (3072, 576), (576, 1536), (8192, 576), (960, 576), (49152, 576)]:
    for dt in (torch.float32, torch.bfloat16):
        t = L.time_shape(nn.Linear(k, n, bias=False).to(dt), rows=(1, 4, 8), budget_s=0.3)
        print(f"{n}x{k} {str(dt)[6:]:8s} rows 1/4/8  stock " + " ".join(f"{v:.3f}" for v in t["stock_ms"]) +
              " | onednn " + " ".join(f"{v:.3f}" for v in t["packed_ms"]) + " | stream " + " ".join(f"{v:.3f}" for v in t.get("stream_ms", [])), flush=True)
