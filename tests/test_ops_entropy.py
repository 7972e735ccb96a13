"""topk_entropy and entropy_bin_policy vs the references (every device), plus golden cases."""

import math

import pytest
import torch

import heterospec.ops as ops
from reference import entropy_bin_policy_ref, topk_entropy_ref
from reference.samples import strided

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _check_topk(logits, k, parent=None, device="cpu"):
    lp, ids, h = ops.topk_entropy(logits.to(device), k, None if parent is None else parent.to(device))
    rlp, rids, rh = topk_entropy_ref(logits, k, parent)
    assert lp.dtype == torch.float32 and ids.dtype == torch.int64 and h.dtype == torch.float32
    assert lp.shape == (logits.shape[0], k) and ids.shape == (logits.shape[0], k) and h.shape == (logits.shape[0],)
    torch.testing.assert_close(ids.cpu(), rids, rtol=0, atol=0)
    torch.testing.assert_close(lp.cpu(), rlp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(h.cpu(), rh, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "M,V,k",
    [(1, 2, 1), (1, 2, 2), (3, 7, 5), (5, 8, 8), (2, 9, 3), (4, 100, 10), (16, 1000, 64), (7, 4099, 16),
     (3, 32000, 8), (2, 49152, 10), (1, 128256, 4), (1, 152064, 64)],
)
def test_topk_entropy_random(devices, dtype, M, V, k):
    logits = (torch.randn(M, V) * 4).to(dtype)
    _check_topk(logits, k, device=devices)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_entropy_parent_and_batch(devices, dtype):
    for M in (1, 2, 5, 16, 64):
        logits = (torch.randn(M, 513) * 2).to(dtype)
        parent = torch.rand(M) * 3
        _check_topk(logits, 6, parent, device=devices)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_entropy_ties_and_duplicates(devices, dtype):
    # Few distinct values: many ties everywhere, including across the k-th boundary.
    logits = torch.randint(-3, 3, (6, 300)).to(dtype)
    _check_topk(logits, 17, device=devices)
    # A constant row: ids 0..k-1, entropy log k.
    const = torch.zeros(2, 50, dtype=dtype)
    lp, ids, h = ops.topk_entropy(const.to(devices), 5)
    assert ids.cpu().tolist() == [[0, 1, 2, 3, 4]] * 2
    torch.testing.assert_close(h.cpu(), torch.full((2,), math.log(5)))
    torch.testing.assert_close(lp.cpu(), torch.full((2, 5), -math.log(50)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_entropy_neg_inf(devices, dtype):
    logits = torch.randn(5, 64)
    logits[torch.rand(5, 64) < 0.5] = -math.inf
    logits[0, :] = -math.inf
    logits[0, 7] = 1.0  # a single finite logit: entropy 0, the rest of the top-k is -inf
    logits[1, :60] = -math.inf  # fewer finite logits than k
    _check_topk(logits.to(dtype), 8, device=devices)
    lp, ids, h = ops.topk_entropy(logits[:1].to(dtype).to(devices), 3)
    assert ids.cpu().tolist() == [[7, 0, 1]]  # -inf ties broken by the lower id
    assert lp[0, 0].item() == 0.0 and math.isinf(lp[0, 1].item())
    assert h.item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_entropy_noncontiguous(devices, dtype):
    base = (torch.randn(6, 2 * 777) * 3).to(dtype)
    _check_topk(base[:, ::2], 9, device=devices)  # strided vocabulary: copied
    _check_topk(base[:, 5:700], 9, device=devices)  # strided rows, contiguous vocabulary: fast path
    _check_topk(base.reshape(2 * 777, 6).t()[:, :40], 4, device=devices)  # transposed


def test_topk_entropy_empty_and_large_values(devices):
    lp, ids, h = ops.topk_entropy(torch.empty(0, 10, device=devices), 3)
    assert lp.shape == (0, 3) and ids.shape == (0, 3) and h.shape == (0,)
    _check_topk(torch.tensor([[1e30, -1e30, 3e38, 0.0]]), 2, device=devices)
    _check_topk(torch.tensor([[-200.0, -150.0, -300.0]]), 3, device=devices)


def test_topk_entropy_golden(devices):
    # p = softmax([log 4, log 2, log 1, log 1]) = [1/2, 1/4, 1/8, 1/8]; top-2 renormalised = [2/3, 1/3].
    logits = torch.tensor([[math.log(4), math.log(2), 0.0, 0.0]], device=devices)
    lp, ids, h = ops.topk_entropy(logits, 2, torch.tensor([0.5], device=devices))
    assert ids.cpu().tolist() == [[0, 1]]
    torch.testing.assert_close(lp.cpu(), torch.tensor([[math.log(0.5), math.log(0.25)]]))
    expected = 0.5 - (2 / 3) * math.log(2 / 3) - (1 / 3) * math.log(1 / 3)
    torch.testing.assert_close(h.cpu(), torch.tensor([expected]))


# ---------------------------------------------------------------- entropy_bin_policy
def test_entropy_bin_policy_random(devices):
    for nb in (1, 2, 3, 6):
        edges = torch.sort(torch.rand(nb - 1) * 4).values
        h = torch.rand(37) * 5
        h[:3] = edges[:3] if nb > 3 else h[:3]  # values exactly on an edge go to the lower bin
        h[5] = float("nan")
        xd = torch.randint(0, 5, (nb,))
        bb = torch.randint(1, 100, (nb,))
        out = ops.entropy_bin_policy(h.to(devices), edges.to(devices), xd.to(devices), bb.to(devices))
        ref = entropy_bin_policy_ref(h, edges, xd, bb)
        for o, r in zip(out, ref):
            assert o.dtype == torch.int64
            assert torch.equal(o.cpu(), r)


def test_entropy_bin_policy_noncontiguous(devices):
    edges = torch.tensor([0.5, 1.5, 3.0])
    h = torch.rand(29, generator=torch.Generator().manual_seed(1)) * 4
    xd, bb = torch.tensor([3, 2, 1, 0]), torch.tensor([10, 20, 40, 60])
    args = [strided(t.to(devices)) for t in (h, edges, xd, bb)]
    for o, r in zip(ops.entropy_bin_policy(*args), entropy_bin_policy_ref(h, edges, xd, bb)):
        assert torch.equal(o.cpu(), r)


def test_entropy_bin_policy_golden(devices):
    h = torch.tensor([0.0, 1.0, 1.5, 2.0, 9.0, float("nan"), -1.0], device=devices)
    edges = torch.tensor([1.0, 2.0], device=devices)
    depth = torch.tensor([2, 1, 0], device=devices)
    budget = torch.tensor([80, 60, 40], device=devices)
    bins, d, n = ops.entropy_bin_policy(h, edges, depth, budget)
    assert bins.cpu().tolist() == [0, 0, 1, 1, 2, 2, 0]
    assert d.cpu().tolist() == [2, 2, 1, 1, 0, 0, 2]
    assert n.cpu().tolist() == [80, 80, 60, 60, 40, 40, 80]


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX"),
                    reason="the scalar path is already the default here")
def test_topk_entropy_portable_scalar_path():
    """x86 runs the AVX2 kernel; HETEROSPEC_CPU_SCALAR=1 (read once per process) forces the
    portable loop that other CPUs run, and the CPU cases of this file must hold for it too."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, HETEROSPEC_CPU_SCALAR="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
           "-k", "topk_entropy and cpu and not scalar_path"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout
