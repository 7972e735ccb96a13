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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[1, 2, 3], [0, 2], [3], [2, 0, 3, 1], [3, 3, 0], [0, 1, 2, 3]])
def test_keep_rows_is_index_select_of_the_requests(devices, dtype, rows):
    """KVCache.keep_rows keeps the requests ``rows`` in that order, in both K and V, and the
    cache stays contiguous (compact_kv_ needs it) and writable. On a CPU it is written into the
    cache's own storage (no new cache-sized allocation); any order, repeats included, works."""
    from heterospec.models.kv_cache import KVCache

    dev = devices
    cache = KVCache(3, 4, 20, 2, 8, dtype=dtype, device=dev)
    g = torch.Generator().manual_seed(len(rows))
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(dtype))
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    want_k, want_v = cache.k.index_select(1, idx).clone(), cache.v.index_select(1, idx).clone()
    ptr = cache.k.data_ptr()
    cache.keep_rows(idx)
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v)
    assert cache.k.is_contiguous() and cache.v.is_contiguous() and cache.batch_size == len(rows)
    assert dev != "cpu" or cache.k.data_ptr() == ptr
    accept_path = torch.zeros(len(rows), 1, dtype=torch.int64, device=dev)
    zeros = torch.zeros(len(rows), dtype=torch.int64, device=dev)
    cache.compact(accept_path, zeros, zeros + 5)       # still a valid cache for the op


def test_keep_rows_rejects_bad_rows_and_leaves_the_cache_as_it_was(devices):
    from heterospec.models.kv_cache import KVCache

    dev = devices
    cache = KVCache(2, 3, 8, 1, 4, device=dev)
    cache.k.copy_(torch.arange(cache.k.numel(), dtype=torch.float32).view(cache.k.shape))
    before = cache.k.clone()
    for bad, match in ((torch.tensor([[0, 1]]), "1-D"), (torch.tensor([], dtype=torch.int64), "non-empty"),
                       (torch.tensor([0.0, 1.0]), "int64"), (torch.tensor([0, 3]), r"\[0, 3\)"),
                       (torch.tensor([-1]), r"\[0, 3\)")):
        with pytest.raises(ValueError, match=match):
            cache.keep_rows(bad.to(dev))
    assert torch.equal(cache.k, before) and cache.batch_size == 3
