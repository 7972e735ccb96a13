import torch, time
from heterospec.models.linear import _random_codes
from heterospec.ops import stream_linear_blocks
torch.set_num_threads(1)
N, K = 1536, 576
copies = [_random_codes(N, K, "q4_1") for _ in range(128)]
x = torch.randn(1, K)
def best(fn, reps=30):
    b = 1e9
    for _ in range(reps):
        t = time.perf_counter(); fn(); b = min(b, time.perf_counter() - t)
    return b
hot = best(lambda: [stream_linear_blocks(x, *copies[0], None, N) for _ in range(128)]) / 128
cold = best(lambda: [stream_linear_blocks(x, *c, None, N) for c in copies]) / 128
nbytes = sum(t.numel() * t.element_size() for t in copies[0])
print("1 thread, 1 row, %dx%d q4_1 (%.0f KB): hot %.1f us (%.1f GB/s), cold %.1f us (%.1f GB/s); %.2f cycles/k/block at 3.5 GHz (hot)" % (
    N, K, nbytes / 1e3, hot * 1e6, nbytes / hot / 1e9, cold * 1e6, nbytes / cold / 1e9, hot * 3.5e9 / (K * N / 32)))
