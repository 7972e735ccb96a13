import torch, time
import heterospec.models.draft as DM
from heterospec import Engine
from heterospec.models.draft import DraftTreeState
torch.set_num_threads(2)
eng = Engine.from_pretrained()
d = eng.draft
B, k, W = 1, 4, 300
cache = d.new_cache(B, 512)
cache.k.normal_(); cache.v.normal_()
prefix = torch.tensor([W])
H = d.config.hidden_size
with torch.inference_mode():
    ids = torch.randint(0, 49152, (B, k)); hid = torch.randn(B, k, H)
    feats = torch.randn(B, 3, 3 * H); eids = torch.randint(0, 49152, (B, 3))
    pos = (prefix + 1)[:, None].expand(B, k)
    def steps():
        st = DraftTreeState()
        d.tree_step(ids, hid, torch.full((B, k), -1), pos, cache, prefix, st)
        return d.tree_step(ids, hid, torch.arange(k)[None].expand(B, k), pos + 1, cache, prefix, st)
    def ext():
        return d.extend(eids, feats, cache, prefix, torch.tensor([3]))
    def logits():
        return d.logits(hid)
    for flag in (False, True, False, True):
        DM.STREAMED_DRAFT = flag
        for f, n in ((steps, 2), (ext, 1), (logits, 1)):
            for _ in range(20): f()
            t = time.perf_counter()
            for _ in range(200): f()
            print(flag, f.__name__, "%.3f ms per call" % ((time.perf_counter() - t) / (200 * n) * 1e3))
    DM.STREAMED_DRAFT = True
    from torch.profiler import profile
    with profile() as prof:
        for _ in range(50): steps()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
