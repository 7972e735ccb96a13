# The 90 MLP linears of the built-in target (30 layers x gate, up, down), cache-cold in turn: stream_linear on the
# float32 weight vs stream_linear_blocks on its Q4_1 codes vs F.linear (MKL), best of 5 passes x 2, 2 threads.
import torch, os, time, sys
from safetensors.torch import load_file
from heterospec import ops
torch.set_num_threads(2)
sd = load_file(os.path.expanduser("~/.cache/heterospec/smollm2-135m-instruct/model.safetensors"))
names = ["model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.down_proj.weight", "model.layers.3.self_attn.k_proj.weight", "model.embed_tokens.weight"]
for n in names:
    w = sd[n]
    t = time.perf_counter(); r = ops.stream_linear_pack_blocks(w); tp = time.perf_counter() - t
    fmt, codes, scales = r
    pk = ops.stream_linear_pack(w)
    for M in (1, 3, 8, 13):
        x = torch.randn(M, w.shape[1])
        a = ops.stream_linear(x, pk, None, w.shape[0]); b = ops.stream_linear_blocks(x, codes, scales, None, w.shape[0])
        assert torch.equal(a, b), (n, M, (a - b).abs().max())
    print(n, fmt, tuple(codes.shape), "pack s", round(tp, 2), "bytes", codes.numel() * codes.element_size() + scales.numel() * 4, "vs", w.numel() * 4)
# speed, cache-cold: many copies of a layer set
def bench(fns, reps=5):
    for f in fns: f()
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        for f in fns: f()
        best = min(best, time.perf_counter() - t)
    return best * 1e3
layers = [sd[f"model.layers.{i}.mlp.{p}_proj.weight"] for i in range(30) for p in ("gate", "up", "down")]
pks = [ops.stream_linear_pack(w) for w in layers]
bls = [ops.stream_linear_pack_blocks(w) for w in layers]
for M in (1, 2, 4, 8, 16):
    xs = {w.shape[1]: torch.randn(M, w.shape[1]) for w in layers}
    f32 = [lambda w=w, p=p: ops.stream_linear(xs[w.shape[1]], p, None, w.shape[0]) for w, p in zip(layers, pks)]
    blk = [lambda w=w, b=b: ops.stream_linear_blocks(xs[w.shape[1]], b[1], b[2], None, w.shape[0]) for w, b in zip(layers, bls)]
    mkl = [lambda w=w: torch.nn.functional.linear(xs[w.shape[1]], w) for w in layers]
    r = [(bench(f32), bench(blk), bench(mkl)) for _ in range(2)]
    a = min(x[0] for x in r); b = min(x[1] for x in r); c = min(x[2] for x in r)
    print(f"rows {M}: 90 MLP linears  f32 stream {a:.2f} ms  blocks {b:.2f} ms  mkl {c:.2f} ms  ratio {b/a:.3f}")
