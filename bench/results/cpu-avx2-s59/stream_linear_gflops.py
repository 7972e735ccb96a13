import torch, time
from heterospec import ops
from heterospec.models.linear import q8_0_values
torch.manual_seed(0)
for th in (1, 2):
    torch.set_num_threads(th)
    for N, K in ((49152, 576), (1536, 576), (576, 1536)):
        w = q8_0_values(torch.randn(N, K) * 0.02)
        fmt, codes, scales = ops.stream_linear_pack_blocks(w)
        row = []
        for M in (1, 2, 4, 6, 8, 12, 16):
            x = torch.randn(M, K)
            for _ in range(3): torch.ops.heterospec.stream_linear_blocks(x, codes, scales, None, N)
            n = max(3, int(200 / (N * K / 1e6)))
            t = time.perf_counter()
            for _ in range(n): torch.ops.heterospec.stream_linear_blocks(x, codes, scales, None, N)
            dt = (time.perf_counter() - t) / n
            row.append("M%d %.3fms %.0fGF" % (M, dt * 1e3, 2 * M * N * K / dt / 1e9))
        print(th, fmt, N, K, " ".join(row))
