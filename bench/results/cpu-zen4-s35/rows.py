import time, torch, statistics
from heterospec.engine import Engine
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
cache = tgt.new_cache(1, 1024)
with torch.inference_mode():
    tgt(torch.tensor([list(range(100, 400))]), torch.arange(300)[None], cache, torch.zeros(1, dtype=torch.int64), None, torch.tensor([300]), return_features=False, logits_index=torch.tensor([[299]]))
    lens = torch.tensor([300])
    Ts = [1, 2, 3, 4, 5, 6, 7, 8]
    res = {T: [] for T in Ts}
    for it in range(12):
        for T in Ts:
            ids = torch.randint(0, 1000, (1, T)); pos = lens[:, None] + torch.arange(T)[None]
            t = time.perf_counter()
            for _ in range(5): tgt(ids, pos, cache, lens, None, None, return_features=True, taps=eng._taps)
            res[T].append((time.perf_counter() - t) / 5)
    base = res[1]
    for T in Ts: print(T, f"{statistics.median(res[T])*1e3:.2f} ms  ratio {statistics.median([a/b for a,b in zip(res[T],base)]):.3f}")
