import time, torch
from vllm.platforms import current_platform
from vllm.v1.sample.sampler import Sampler
from heterospec.vllm_plugin.exact_match import draw_token
torch.set_num_threads(2)
s = Sampler()
V = 49152
logits = torch.randn(V)
g = torch.Generator().manual_seed(1)
for _ in range(50): draw_token(s, logits, g)
t = time.perf_counter(); n = 500
for _ in range(n): draw_token(s, logits, g)
dt = (time.perf_counter() - t) / n
t = time.perf_counter()
for _ in range(n):
    a = torch.Generator(); a.set_state(g.get_state())
ds = (time.perf_counter() - t) / n
print(f"draw_token V={V}: {dt*1e6:.1f} us; generator copy: {ds*1e6:.1f} us")
from heterospec.vllm_plugin.exact_match import advance
t = time.perf_counter()
for _ in range(n): advance(s, g, 1, V, "cpu")
print(f"advance by one token: {(time.perf_counter() - t) / n * 1e6:.1f} us")
a = torch.Generator().manual_seed(5); b = torch.Generator().manual_seed(5)
advance(s, a, 3, V, "cpu")
for _ in range(3): draw_token(s, logits, b)
print("same state after 3:", torch.equal(a.get_state(), b.get_state()))
