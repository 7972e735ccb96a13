"""decoder_layer_ on and off where the tuned linears run gate/up (or Q/K/V) as separate calls:
target forwards of 1-16 tree tokens (B=1) and 8 / 16 one-token rows (a batch's plain step),
context 256, in-process, best of 15 alternations."""
import torch, time
from heterospec import Engine, ops
import heterospec.models.target as TM
torch.set_num_threads(2)
eng = Engine.from_pretrained()
tgt = eng.target
ctx = 256
with torch.inference_mode():
    fns = {}
    for B in (1, 8, 16):
        cache = tgt.new_cache(B, ctx + 40)
        zero = torch.zeros(B, dtype=torch.int64)
        tgt(torch.randint(0, 49152, (B, ctx)), torch.arange(ctx).expand(B, ctx), cache, zero, None, None,
            return_features=False)
        prefix = torch.full((B,), ctx, dtype=torch.int64)
        for T in ((1, 4, 8, 12, 16) if B == 1 else (1,)):
            parents = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, T)]] * B)
            num = torch.full((B,), T)
            mask, pos, _, _ = ops.build_tree(parents, num, prefix)
            toks = torch.randint(0, 49152, (B, T))
            fns[(B, T)] = (lambda toks=toks, pos=pos, cache=cache, prefix=prefix, mask=mask, num=num:
                           tgt(toks, pos, cache, prefix, mask, num, return_features=True, taps=eng._taps))
    best = {(a, k): 1e9 for a in (False, True) for k in fns}
    outs = {}
    for r in range(15):
        for a in (False, True):
            TM.LAYER_OP = a
            for k, f in fns.items():
                t = time.perf_counter(); o = f(); best[(a, k)] = min(best[(a, k)], time.perf_counter() - t)
                outs[(a, k)] = o[0]
    for k in fns:
        print("B%d T%d rows %d: calls %.2f ms, layer op %.2f ms (%.3f), same logits: %s" % (
            k[0], k[1], k[0] * k[1], best[(False, k)] * 1e3, best[(True, k)] * 1e3, best[(True, k)] / best[(False, k)],
            torch.equal(outs[(False, k)], outs[(True, k)])))
    TM.LAYER_OP = True
    with torch.profiler.profile() as prof:
        fns[(8, 1)]()
    print("layer op used at 8 rows:", "heterospec::decoder_layer_" in {e.name for e in prof.events()})
