"""compact_kv_ vs the reference, in place, every dtype; golden case."""

import pytest
import torch

import heterospec.ops as ops
from reference import compact_kv_ref
from reference.samples import strided


def _random_paths(B, P, S, g):
    accept_path = torch.full((B, P), -1, dtype=torch.int64)
    accept_len = torch.zeros(B, dtype=torch.int64)
    prefix_lens = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        n = int(torch.randint(0, P, (1,), generator=g))
        steps = torch.randint(1, 4, (n,), generator=g)
        path = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(steps, 0)])
        L = int(torch.randint(0, max(1, S - int(path[-1])), (1,), generator=g))
        accept_path[b, : n + 1] = path
        accept_len[b] = n
        prefix_lens[b] = L
    return accept_path, accept_len, prefix_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("NL,B,S,H,D,P", [(1, 1, 4, 1, 1, 1), (2, 3, 40, 2, 8, 6), (3, 16, 64, 4, 16, 12),
                                          (1, 2, 300, 1, 128, 128)])
def test_compact_kv_random(devices, dtype, NL, B, S, H, D, P):
    g = torch.Generator().manual_seed(NL * 100 + B * 10 + P)
    k = (torch.randn(NL, B, S, H, D, generator=g) * 10).to(dtype)
    v = (torch.randn(NL, B, S, H, D, generator=g) * 10).to(dtype)
    accept_path, accept_len, prefix_lens = _random_paths(B, P, S, g)
    rk, rv = compact_kv_ref(k, v, accept_path, accept_len, prefix_lens)
    kd, vd = k.to(devices), v.to(devices)
    k_ptr = kd.data_ptr()
    out = ops.compact_kv_(kd, vd, accept_path.to(devices), accept_len.to(devices), prefix_lens.to(devices))
    assert out is None and kd.data_ptr() == k_ptr  # in place
    assert torch.equal(kd.cpu(), rk) and torch.equal(vd.cpu(), rv)


def test_compact_kv_noncontiguous_indices(devices):
    """The caches must be contiguous (an error otherwise); the index tensors may be any view."""
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 4, 30, 2, 4, generator=g), torch.randn(2, 4, 30, 2, 4, generator=g)
    accept_path, accept_len, prefix_lens = _random_paths(4, 6, 30, g)
    rk, rv = compact_kv_ref(k, v, accept_path, accept_len, prefix_lens)
    kd, vd = k.to(devices), v.to(devices)
    ops.compact_kv_(kd, vd, *[strided(t.to(devices)) for t in (accept_path, accept_len, prefix_lens)])
    assert torch.equal(kd.cpu(), rk) and torch.equal(vd.cpu(), rv)


def test_compact_kv_golden(devices):
    # one layer, two requests, S = 8, H = D = 1; cache value = 10 * request + slot.
    k = (torch.arange(2)[:, None] * 10 + torch.arange(8)[None, :]).float().reshape(1, 2, 8, 1, 1)
    v = -k
    accept_path = torch.tensor([[0, 2, 3, -1], [0, -1, -1, -1]])
    accept_len = torch.tensor([2, 0])
    prefix_lens = torch.tensor([3, 5])
    k, v = k.to(devices), v.to(devices)
    ops.compact_kv_(k, v, accept_path.to(devices), accept_len.to(devices), prefix_lens.to(devices))
    # request 0: slots 3,4,5 <- 3,5,6 ; request 1 unchanged.
    assert k.cpu().flatten().tolist() == [0, 1, 2, 3, 5, 6, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17]
    assert torch.equal(v, -k)
