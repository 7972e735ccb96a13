import torch, time, json, sys
from heterospec import Engine, ops
import heterospec.models.target as TM
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
ctx = 256
res = {}
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
    Ts = (1, 2, 4, 8)
    fns = {T: mk(T) for T in Ts}
    outs = {}
    best = {(f, T): 1e9 for f in (False, True) for T in Ts}
    for r in range(15):
        for f in (False, True):
            TM.ROPE_KV_WRITE = f
            for T in Ts:
                t = time.perf_counter(); o = fns[T](); best[(f, T)] = min(best[(f, T)], time.perf_counter() - t)
                outs[(f, T)] = o[0]
    for T in Ts:
        print("T%d off %.2f on %.2f ms  ratio %.3f  same logits %s" % (T, best[(False, T)] * 1e3, best[(True, T)] * 1e3,
              best[(True, T)] / best[(False, T)], torch.equal(outs[(False, T)], outs[(True, T)])))
    with torch.profiler.profile() as prof:
        fns[1]()
    print("op used:", "heterospec::rope_kv_write_" in {e.name for e in prof.events()})
