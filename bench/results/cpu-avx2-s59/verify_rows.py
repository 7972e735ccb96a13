import torch, time, sys, json
from heterospec import Engine, ops
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 256
with torch.inference_mode():
    cache = tgt.new_cache(1, ctx + 40)
    zero = torch.zeros(1, dtype=torch.int64)
    tgt(torch.randint(0, 49152, (1, ctx)), torch.arange(ctx)[None], cache, zero, None, None, return_features=False)
    prefix = torch.full((1,), ctx, dtype=torch.int64)
    def mk(T):
        parents = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, T)]])
        num = torch.tensor([T])
        mask, pos, _, _ = ops.build_tree(parents, num, prefix)
        toks = torch.randint(0, 49152, (1, T))
        return lambda: tgt(toks, pos, cache, prefix, mask, num, return_features=True, taps=eng._taps)
    Ts = (1, 2, 4, 6, 8, 12, 16)
    fns = {T: mk(T) for T in Ts}
    best = {T: 1e9 for T in Ts}
    for r in range(9):
        for T in Ts:
            t = time.perf_counter(); fns[T](); best[T] = min(best[T], time.perf_counter() - t)
    print(json.dumps({T: round(best[T] * 1e3, 2) for T in Ts}))
