"""Target step then draft extend + head, T0 against NTA prefetch hints in the block kernels (a temporary HS_NTA switch of this session, not shipped)."""
import torch, time, os
from heterospec import Engine, ops
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt, d = eng.target, eng.draft
ctx = 256
with torch.inference_mode():
    cache = tgt.new_cache(1, ctx + 400)
    tgt(torch.randint(0, 49152, (1, ctx)), torch.arange(ctx)[None], cache, torch.zeros(1, dtype=torch.int64), None, None, return_features=False)
    dcache = d.new_cache(1, 700)
    feats = torch.randn(1, 300, 3 * 576); ids = torch.randint(0, 49152, (1, 300))
    d.extend(ids[:, :200], feats[:, :200], dcache, torch.zeros(1, dtype=torch.long), torch.tensor([200]))
    prefix = torch.full((1,), ctx, dtype=torch.int64)
    dpl = torch.tensor([200])
    toks = torch.randint(0, 49152, (1, 1))
    res = {}
    for r in range(40):
        for arm in ("T0", "NTA"):
            if arm == "NTA": os.environ["HS_NTA"] = "1"
            else: os.environ.pop("HS_NTA", None)
            t0 = time.perf_counter()
            tgt(toks, prefix[:, None], cache, prefix, None, None, return_features=True, taps=eng._taps)
            t1 = time.perf_counter()
            h = d.extend(ids[:, :2], feats[:, :2], dcache, dpl, torch.tensor([2]))
            lg = d.logits(h[:, -1:])
            t2 = time.perf_counter()
            res.setdefault((arm, "target"), []).append(t1 - t0); res.setdefault((arm, "draft"), []).append(t2 - t1)
    for k, v in sorted(res.items()):
        v.sort(); print(k, "min %.3f med %.3f ms" % (v[0] * 1e3, v[len(v) // 2] * 1e3))
