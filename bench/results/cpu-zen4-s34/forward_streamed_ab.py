# One target forward (built-in pair, float32, 300 tokens of context) with STREAMED_LAYERS off / on, bit-equality checked, alternated twice per shape (thirty-fourth session).
import time, torch
from heterospec.engine import Engine
from heterospec.models import target as TM
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
_im = torch.inference_mode(); _im.__enter__()
for B, T in ((1, 1), (1, 8), (2, 5), (1, 13)):
    cache = tgt.new_cache(B, 1024)
    tgt(torch.randint(0, 40000, (B, 300)), torch.arange(300).expand(B, 300), cache, torch.zeros(B, dtype=torch.long))
    pl = torch.tensor([300, 290][:B]); x = torch.randint(0, 40000, (B, T)); pos = pl[:, None] + torch.arange(T)
    tm = torch.rand(B, T, T) < 0.5; tm = (tm.tril() | torch.eye(T, dtype=torch.bool)); tm[:, :, 0] = True
    res = {}
    for flag in (False, True):
        TM.STREAMED_LAYERS = flag
        res[flag] = tgt(x, pos, cache, pl, tree_mask=tm)
        assert flag is False or tgt._stream_plans(tgt.embed_tokens(x)) is not None
    print(B, T, "logits equal:", torch.equal(res[False][0], res[True][0]), "features equal:", torch.equal(res[False][1], res[True][1]))
    def run(): return tgt(x, pos, cache, pl, tree_mask=tm)
    ms = {False: [], True: []}
    for rep in range(7):
        for flag in ((False, True) if rep % 2 == 0 else (True, False)):
            TM.STREAMED_LAYERS = flag
            for _ in range(2): run()
            R = 15; t = time.perf_counter()
            for _ in range(R): run()
            ms[flag].append((time.perf_counter() - t) / R * 1e3)
    med = {f: sorted(v)[len(v) // 2] for f, v in ms.items()}
    print(f"   modules {med[False]:.2f} ms, streamed {med[True]:.2f} ms (median of 7 alternated runs of 15): "
          f"streamed / modules {med[True] / med[False]:.3f}")
