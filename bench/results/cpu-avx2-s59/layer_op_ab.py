import torch, time
from heterospec import Engine, ops
import heterospec.models.target as TM
torch.set_num_threads(2)
print(torch.ops.heterospec.stream_linear_blocks.default is torch.ops.heterospec.stream_linear_blocks.default)
eng = Engine.from_pretrained()
tgt = eng.target
ctx = 256
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
    arms = {"calls": (False, False), "rope_kv": (True, False), "layer_op": (True, True)}
    best = {(a, T): 1e9 for a in arms for T in Ts}
    outs = {}
    for r in range(15):
        for a, (rk, lo) in arms.items():
            TM.ROPE_KV_WRITE, TM.LAYER_OP = rk, lo
            for T in Ts:
                t = time.perf_counter(); o = fns[T](); best[(a, T)] = min(best[(a, T)], time.perf_counter() - t)
                outs[(a, T)] = (o[0], o[1])
    for T in Ts:
        base = best[("calls", T)]
        print("T%d " % T + "  ".join("%s %.2f ms (%.3f)" % (a, best[(a, T)] * 1e3, best[(a, T)] / base) for a in arms),
              "same:", all(torch.equal(outs[(a, T)][0], outs[("calls", T)][0]) and torch.equal(outs[(a, T)][1], outs[("calls", T)][1]) for a in arms))
    TM.ROPE_KV_WRITE, TM.LAYER_OP = True, True
    with torch.profiler.profile() as prof:
        fns[1]()
    print("layer op used:", "heterospec::decoder_layer_" in {e.name for e in prof.events()})
