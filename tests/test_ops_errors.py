"""Bad inputs for every op: a clear ValueError naming the problem, never a crash or a silent
out-of-bounds read. Each case goes through both the Python wrapper (heterospec.ops) and the raw
op (torch.ops.heterospec.*), so the C++ checks are exercised on their own as well."""

import math

import pytest
import torch

import heterospec.ops as ops

raw = torch.ops.heterospec
nan, inf = math.nan, math.inf
i64 = torch.int64


def L(*x):
    return torch.tensor(x, dtype=i64)


def F(*x):
    return torch.tensor(x, dtype=torch.float32)


# ---- one valid call per op; cases below replace single arguments --------------------------------
def valid(op):
    if op == "topk_entropy":
        return [torch.randn(3, 10), 2, torch.zeros(3)]
    if op == "entropy_bin_policy":
        return [F(0.5, 2.0), F(1.0), L(1, 0), L(8, 4)]
    if op == "select_tree_nodes":
        return [F(-1.0, -2.0, -3.0)[None], L(-1, 0, 1)[None], L(2), 2]
    if op == "build_tree":
        return [L(-1, 0, 1)[None], L(3), L(4)]
    if op == "tree_attention_mask":
        return [torch.eye(3, dtype=torch.bool)[None], L(3), L(2), 15]
    if op == "dense_tree_attention_mask":
        return [torch.eye(3, dtype=torch.bool)[None], L(2), 5]
    if op == "verify_greedy":
        return [L(5, 6, 7)[None], L(6, 7, 8)[None], L(1, 2, -1)[None], L(-1, -1, -1)[None], L(3)]
    if op == "verify_sampling":
        return [L(0, 1, 2)[None], torch.full((1, 3, 4), 0.25), L(1, 2, -1)[None], L(-1, -1, -1)[None], L(3),
                F(0.5, 0.5, 0.5)[None], F(0.5)]
    if op == "compact_kv_":
        k = torch.zeros(2, 1, 8, 1, 2)
        return [k, k.clone(), L(0, 2, -1)[None], L(1), L(3)]
    raise KeyError(op)


ARG = {  # argument positions by name
    "topk_entropy": ["logits", "k", "parent_entropy"],
    "entropy_bin_policy": ["path_entropy", "bin_edges", "bin_extra_depth", "bin_budget"],
    "select_tree_nodes": ["scores", "parents", "budgets", "max_nodes"],
    "build_tree": ["tree_parents", "num_nodes", "prefix_lens"],
    "tree_attention_mask": ["tree_mask", "num_nodes", "prefix_lens", "mask_numel"],
    "dense_tree_attention_mask": ["tree_mask", "prefix_lens", "width"],
    "verify_greedy": ["tree_tokens", "target_ids", "first_child", "next_sibling", "num_nodes"],
    "verify_sampling": ["tree_tokens", "target_probs", "first_child", "next_sibling", "num_nodes", "coins",
                        "final_coins"],
    "compact_kv_": ["k_cache", "v_cache", "accept_path", "accept_len", "prefix_lens"],
}

nan_row = torch.randn(3, 10)
nan_row[1, 4] = nan
pinf_row = torch.randn(3, 10)
pinf_row[2, 0] = inf
ninf_row = torch.randn(3, 10)
ninf_row[0] = -inf
neg_probs = torch.full((1, 3, 4), 0.25)
neg_probs[0, 0, 2] = -0.1
nan_probs = torch.full((1, 3, 4), 0.25)
nan_probs[0, 1, 1] = nan
zero_probs = torch.full((1, 3, 4), 0.25)
zero_probs[0, 0] = 0.0

CASES = [
    # (op, {arg: bad value}, message regex)
    ("topk_entropy", {"logits": torch.randn(3, 10, dtype=torch.float64)}, "expected logits of dtype torch.float32, "
     "torch.float16 or torch.bfloat16, got torch.float64"),
    ("topk_entropy", {"logits": torch.randint(0, 5, (3, 10))}, "expected logits of dtype"),
    ("topk_entropy", {"logits": torch.randn(10), "parent_entropy": None}, "expected logits to have 2 dimensions"),
    ("topk_entropy", {"k": 0}, r"expected 1 <= k <= min\(V, 64\) = 10 \(V = logits.size\(1\) = 10\), got k = 0"),
    ("topk_entropy", {"k": 11}, "got k = 11"),
    ("topk_entropy", {"logits": torch.randn(3, 100), "k": 65}, "got k = 65"),
    ("topk_entropy", {"parent_entropy": torch.zeros(3, dtype=torch.float64)}, "expected parent_entropy of dtype "
     "torch.float32, got torch.float64"),
    ("topk_entropy", {"parent_entropy": torch.zeros(4)}, r"expected parent_entropy.size\(0\) == 3"),
    ("topk_entropy", {"parent_entropy": torch.zeros(3, 1)}, "expected parent_entropy to have 1 dimensions"),
    ("topk_entropy", {"logits": nan_row}, "row 1 of logits contains NaN"),
    ("topk_entropy", {"logits": pinf_row}, r"row 2 of logits contains \+inf"),
    ("topk_entropy", {"logits": ninf_row}, "row 0 of logits is all -inf"),
    ("topk_entropy", {"logits": nan_row.half()}, "row 1 of logits contains NaN"),
    ("topk_entropy", {"logits": ninf_row.bfloat16()}, "row 0 of logits is all -inf"),
    ("entropy_bin_policy", {"path_entropy": L(1, 2)}, "expected path_entropy of dtype torch.float32, got torch.int64"),
    ("entropy_bin_policy", {"bin_edges": F(2.0, 1.0), "bin_extra_depth": L(1, 0, 0), "bin_budget": L(1, 2, 3)},
     "expected bin_edges in ascending order"),
    ("entropy_bin_policy", {"bin_edges": F(nan)}, r"bin_edges\[0\] is NaN"),
    ("entropy_bin_policy", {"bin_budget": L(1, 2, 3)}, r"expected bin_budget.size\(0\) == 2 \(num_bins"),
    ("entropy_bin_policy", {"bin_extra_depth": torch.tensor([1, 0], dtype=torch.int32)},
     "expected bin_extra_depth of dtype torch.int64, got torch.int32"),
    ("entropy_bin_policy", {"path_entropy": F(0.5)[None]}, "expected path_entropy to have 1 dimensions"),
    ("select_tree_nodes", {"parents": L(-1, 0, 1)[None].int()}, "expected parents of dtype torch.int64, got "
     "torch.int32"),
    ("select_tree_nodes", {"parents": L(-1, 0, 2)[None]}, r"invalid parents\[0, 2\] = 2"),
    ("select_tree_nodes", {"parents": L(-1, -2, 0)[None]}, r"invalid parents\[0, 1\] = -2"),
    ("select_tree_nodes", {"parents": L(0, 0, 0)[None]}, r"invalid parents\[0, 0\] = 0"),
    ("select_tree_nodes", {"budgets": L(3)}, r"expected 0 <= budgets\[0\] <= max_nodes = 2, got 3"),
    ("select_tree_nodes", {"budgets": L(-1)}, r"budgets\[0\]"),
    ("select_tree_nodes", {"budgets": L(1, 1)}, r"expected budgets.size\(0\) == 1"),
    ("select_tree_nodes", {"scores": F(-1.0, nan, -3.0)[None]}, r"scores\[0, 1\] is NaN"),
    ("select_tree_nodes", {"parents": L(-1, 0)[None]}, r"expected parents.size\(1\) == 3"),
    ("select_tree_nodes", {"max_nodes": -1, "budgets": L(0)}, "max_nodes >= 0"),
    ("select_tree_nodes", {"max_nodes": 2**40, "budgets": L(0)}, "max_nodes >= 0 and <= 1048576, got 1099511627776"),
    ("select_tree_nodes", {"scores": F(-1.0, -2.0, -3.0)}, "expected scores to have 2 dimensions"),
    ("build_tree", {"tree_parents": L(0, 0, 1)[None]}, r"expected tree_parents\[0, 0\] == -1"),
    ("build_tree", {"tree_parents": L(-1, 0, 2)[None]}, r"invalid tree_parents\[0, 2\] = 2"),
    ("build_tree", {"tree_parents": L(-1, -1, 0)[None]}, r"invalid tree_parents\[0, 1\] = -1"),
    ("build_tree", {"num_nodes": L(0)}, r"expected 1 <= num_nodes\[0\] <= T = 3, got 0"),
    ("build_tree", {"num_nodes": L(4)}, r"num_nodes\[0\] <= T = 3, got 4"),
    ("build_tree", {"prefix_lens": L(-2)}, r"expected prefix_lens\[0\] >= 0, got -2"),
    ("build_tree", {"prefix_lens": L(1, 2)}, r"expected prefix_lens.size\(0\) == 1"),
    ("build_tree", {"num_nodes": F(3.0)}, "expected num_nodes of dtype torch.int64, got torch.float32"),
    ("tree_attention_mask", {"mask_numel": 14}, r"expected mask_numel == .* = 15, got 14"),
    ("tree_attention_mask", {"tree_mask": torch.eye(3)[None]}, "expected tree_mask of dtype torch.bool"),
    ("tree_attention_mask", {"tree_mask": torch.ones(1, 3, 2, dtype=torch.bool)}, r"expected tree_mask.size\(2\) == 3"),
    ("tree_attention_mask", {"num_nodes": L(4)}, r"num_nodes\[0\] <= T = 3, got 4"),
    ("tree_attention_mask", {"prefix_lens": L(-1)}, r"prefix_lens\[0\] >= 0"),
    ("dense_tree_attention_mask", {"width": 4}, r"expected prefix_lens\[0\] \+ T <= width"),
    ("dense_tree_attention_mask", {"prefix_lens": L(-1)}, r"prefix_lens\[0\] >= 0"),
    ("dense_tree_attention_mask", {"tree_mask": torch.eye(3, dtype=torch.bool)}, "expected tree_mask to have 3 dim"),
    ("verify_greedy", {"first_child": L(1, 0, -1)[None]}, r"invalid first_child\[0, 1\] = 0"),
    ("verify_greedy", {"first_child": L(3, -1, -1)[None]}, r"invalid first_child\[0, 0\] = 3"),
    ("verify_greedy", {"next_sibling": L(-1, 1, -1)[None]}, r"invalid next_sibling\[0, 1\] = 1"),
    ("verify_greedy", {"num_nodes": L(4)}, r"num_nodes\[0\] <= T = 3, got 4"),
    ("verify_greedy", {"num_nodes": L(2)}, r"invalid first_child\[0, 1\] = 2"),
    ("verify_greedy", {"target_ids": L(6, 7)[None]}, r"expected target_ids.size\(1\) == 3"),
    ("verify_greedy", {"tree_tokens": L(5, 6, 7)}, "expected tree_tokens to have 2 dimensions"),
    ("verify_sampling", {"coins": F(0.5, 1.0, 0.5)[None]}, r"expected coins\[0, 1\] in \[0, 1\), got 1"),
    ("verify_sampling", {"coins": F(-0.1, 0.5, 0.5)[None]}, r"coins\[0, 0\]"),
    ("verify_sampling", {"final_coins": F(1.0)}, r"expected final_coins\[0\] in \[0, 1\)"),
    ("verify_sampling", {"target_probs": neg_probs}, r"target_probs\[0, 0\] is not a valid distribution"),
    ("verify_sampling", {"target_probs": nan_probs, "coins": F(0.1, 0.5, 0.5)[None]},  # node 1 is visited
     r"target_probs\[0, 1\] is not a valid distribution"),
    ("verify_sampling", {"target_probs": zero_probs}, r"target_probs\[0, 0\] is not a valid distribution"),
    ("verify_sampling", {"tree_tokens": L(0, 4, 2)[None]}, r"tree_tokens\[0, 1\] = 4 is not a token id in \[0, V = 4\)"),
    ("verify_sampling", {"tree_tokens": L(0, 1, -1)[None]}, r"tree_tokens\[0, 2\] = -1"),
    ("verify_sampling", {"target_probs": torch.full((1, 3, 4), 0.25, dtype=torch.float64)},
     "expected target_probs of dtype torch.float32, got torch.float64"),
    ("verify_sampling", {"target_probs": torch.full((1, 2, 4), 0.25)}, r"expected target_probs.size\(1\) == 3"),
    ("verify_sampling", {"final_coins": F(0.5, 0.5)}, r"expected final_coins.size\(0\) == 1"),
    ("compact_kv_", {"accept_path": L(1, 2, -1)[None]}, r"expected accept_path\[0, 0\] == 0"),
    ("compact_kv_", {"accept_path": L(0, 0, -1)[None]}, "strictly increasing"),
    ("compact_kv_", {"accept_path": L(0, 5, -1)[None]}, r"accepted slot out of range for request 0: prefix_lens \+ "
     r"accept_path\[0, accept_len\] = 3 \+ 5 >= S = 8"),
    ("compact_kv_", {"accept_len": L(3)}, r"expected 0 <= accept_len\[0\] < accept_path.size\(1\) = 3, got 3"),
    ("compact_kv_", {"accept_len": L(-1)}, r"accept_len\[0\]"),
    ("compact_kv_", {"prefix_lens": L(8)}, r"expected 0 <= prefix_lens\[0\] < S = 8, got 8"),
    ("compact_kv_", {"v_cache": torch.zeros(2, 1, 8, 1, 3)}, "expected v_cache of the same shape as k_cache"),
    ("compact_kv_", {"v_cache": torch.zeros(2, 1, 8, 1, 2, dtype=torch.float16)}, "expected v_cache of .*dtype"),
    ("compact_kv_", {"k_cache": torch.zeros(2, 1, 8, 2), "v_cache": torch.zeros(2, 1, 8, 2)},
     "expected k_cache to have 5 dimensions"),
    ("compact_kv_", {"k_cache": torch.zeros(2, 1, 16, 1, 2)[:, :, ::2],
                     "v_cache": torch.zeros(2, 1, 8, 1, 2)}, "expected k_cache to be contiguous"),
    ("compact_kv_", {"accept_path": L(0, 2, -1)}, "expected accept_path to have 2 dimensions"),
    ("compact_kv_", {"accept_len": L(1).int()}, "expected accept_len of dtype torch.int64, got torch.int32"),
]


def _args(op, bad):
    args = valid(op)
    for name, value in bad.items():
        args[ARG[op].index(name)] = value
    return args


@pytest.mark.parametrize("op", list(ARG))
def test_valid_baseline(op):
    """The baseline arguments are valid (so each case below fails only because of its change)."""
    getattr(ops, op)(*valid(op))


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_wrapper(case):
    op, bad, msg = case
    with pytest.raises(ValueError, match=msg):
        getattr(ops, op)(*_args(op, bad))


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_raw_op(case):
    op, bad, msg = case
    with pytest.raises(ValueError, match=msg):
        getattr(raw, op).default(*_args(op, bad))


def test_compact_kv_rejects_aliased_caches():
    k = torch.zeros(1, 1, 4, 1, 1)
    with pytest.raises(ValueError, match="different tensors"):
        raw.compact_kv_.default(k, k, L(0)[None], L(0), L(0))
    base = torch.arange(17.0)    # two offset views of one buffer: distinct pointers, shared rows
    kv, vv = base[0:16].view(1, 1, 16, 1, 1), base[1:17].view(1, 1, 16, 1, 1)
    with pytest.raises(ValueError, match="does not overlap"):
        raw.compact_kv_.default(kv, vv, L(0, 2)[None], L(1), L(3))
    assert torch.equal(base, torch.arange(17.0))     # rejected before anything moved
    apart = torch.zeros(2, 1, 1, 8, 1, 1)             # adjacent halves of one buffer are fine
    raw.compact_kv_.default(apart[0], apart[1], L(0)[None], L(0), L(0))


def test_wrapper_rejects_non_tensors_and_bad_ints():
    with pytest.raises(ValueError, match="expected logits to be a torch.Tensor, got list"):
        ops.topk_entropy([[1.0, 2.0]], 1)
    with pytest.raises(ValueError, match="expected k to be an int, got float"):
        ops.topk_entropy(torch.randn(2, 3), 1.0)
    with pytest.raises(ValueError, match="expected mask_numel >= 0, got -1"):
        ops.tree_attention_mask(*valid("tree_attention_mask")[:3], -1)


def test_device_mismatch_is_reported(devices):
    """Tensors on different devices: the wrapper names the tensor and both devices."""
    other = "meta" if devices == "cpu" else "cpu"
    with pytest.raises(ValueError, match=rf"expected parent_entropy on device {devices}.*got {other}"):
        ops.topk_entropy(torch.randn(3, 10, device=devices), 2, torch.zeros(3, device=other))
    args = [a.to(devices) for a in valid("verify_greedy")]
    args[4] = args[4].to(other)
    with pytest.raises(ValueError, match=rf"expected num_nodes on device {devices}"):
        ops.verify_greedy(*args)


DEVICE_CASES = [(op, i) for op in ARG for i, a in enumerate(valid(op)) if i > 0 and isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("op,i", DEVICE_CASES, ids=[f"{op}-{ARG[op][i]}" for op, i in DEVICE_CASES])
def test_raw_op_device_mismatch_is_an_error(op, i):
    """One tensor on another device: the raw op (whose dispatch then lands in the fake kernel for
    a meta tensor) raises naming it, instead of returning uninitialised outputs."""
    args = valid(op)
    args[i] = args[i].to("meta")
    with pytest.raises(ValueError, match=rf"{op}: expected {ARG[op][i]} on device cpu .*got meta"):
        getattr(raw, op).default(*args)
