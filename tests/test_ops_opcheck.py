"""torch.library.opcheck on every op (schema, fake kernel, dispatch, mutation annotations) and one
torch.compile(fullgraph=True) test of a whole decoding round's op chain."""

import pytest
import torch

import heterospec.ops as ops
from reference import build_tree_ref
from reference.samples import golden_two_request_tree, random_candidates

raw = torch.ops.heterospec


def samples(device):
    """(op name, args) pairs covering every op, small but non-trivial."""
    g = torch.Generator().manual_seed(0)
    tree_parents, num_nodes, prefix_lens = golden_two_request_tree()
    tree_mask, _, fc, ns = build_tree_ref(tree_parents, num_nodes, prefix_lens)
    scores, parents = random_candidates(2, 12, mode="random", gen=g)
    B, T, V = 2, 6, 5
    tokens = torch.randint(0, V, (B, T), generator=g)
    numel = int((num_nodes * (prefix_lens + num_nodes)).sum())
    out = [
        ("topk_entropy", (torch.randn(4, 33, generator=g), 3, None)),
        ("topk_entropy", (torch.randn(4, 33, generator=g).bfloat16(), 5, torch.rand(4, generator=g))),
        ("topk_entropy", (torch.randn(3, 40, generator=g).half()[:, ::2], 1, None)),
        ("entropy_bin_policy", (torch.rand(5, generator=g) * 3, torch.tensor([1.0, 2.0]), torch.tensor([2, 1, 0]),
                                torch.tensor([60, 40, 20]))),
        ("select_tree_nodes", (scores, parents, torch.tensor([4, 7]), 8)),
        ("build_tree", (tree_parents, num_nodes, prefix_lens)),
        ("tree_attention_mask", (tree_mask, num_nodes, prefix_lens, numel)),
        ("dense_tree_attention_mask", (tree_mask, prefix_lens, 10)),
        ("verify_greedy", (tokens, torch.randint(0, V, (B, T), generator=g), fc, ns, num_nodes)),
        ("verify_sampling", (tokens, torch.rand(B, T, V, generator=g), fc, ns, num_nodes, torch.rand(B, T, generator=g),
                             torch.rand(B, generator=g))),
        ("compact_kv_", (torch.randn(2, B, 9, 2, 4, generator=g), torch.randn(2, B, 9, 2, 4, generator=g),
                         torch.tensor([[0, 1, 3, -1], [0, -1, -1, -1]]), torch.tensor([2, 0]), torch.tensor([2, 5]))),
        ("stream_linear_pack", (torch.randn(40, 12, generator=g),)),
        ("stream_linear", (torch.randn(3, 12, generator=g), torch.randn(2, 12, 32, generator=g),
                           torch.randn(40, generator=g), 40)),
        ("stream_linear_blocks", (torch.randn(3, 64, generator=g),
                                  torch.randint(0, 256, (2, 64, 16), dtype=torch.uint8, generator=g),
                                  torch.rand(2, 2, 2, 32, generator=g), torch.randn(40, generator=g), 40)),
        ("rms_norm", (torch.randn(2, 3, 16, generator=g), torch.randn(16, generator=g), 1e-5)),
        ("rope", (torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 2, 8, generator=g),
                  torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g))),
        ("rope_kv_write_", (torch.randn(2, 3, (4 + 2 * 2) * 8, generator=g), torch.randn(2, 3, 8, generator=g),
                            torch.randn(2, 3, 8, generator=g), torch.tensor([4, 0]), torch.empty(2, 3, 4, 8),
                            torch.randn(2, 9, 2, 8, generator=g), torch.randn(2, 9, 2, 8, generator=g))),
        ("tree_attention", (torch.randn(B, T, 4, 16, generator=g), torch.randn(B, 12, 2, 16, generator=g),
                            torch.randn(B, 12, 2, 16, generator=g), torch.tensor([3, 0]),
                            torch.ones(B, T, T, dtype=torch.bool).tril(), 0.25)),
    ]
    # decoder_layer_: H 32, 2 query heads and 1 KV head of 8, MLP 32 wide, float32 weights packed
    lin = [ops.stream_linear_pack(torch.randn(n, k, generator=g) * 0.1) for n, k in ((32, 32), (32, 16), (64, 32),
                                                                                    (32, 32))]
    out.append(("decoder_layer_", (torch.randn(2, 3, 32, generator=g), torch.rand(32, generator=g) + 0.5, 1e-5,
                                   torch.rand(32, generator=g) + 0.5, 1e-5,
                                   [t for w in lin for t in (w, torch.empty(0))], [32, 32, 64, 32],
                                   torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g),
                                   torch.tensor([4, 0]), torch.ones(2, 3, 3, dtype=torch.bool).tril(), 0.35,
                                   torch.empty(2, 3, 32), torch.randn(2, 9, 1, 8, generator=g),
                                   torch.randn(2, 9, 1, 8, generator=g))))
    # ... the EAGLE-3 draft's layer: a 64-wide input, no input norm, its own 32-wide residual,
    # a tree step's 2 earlier columns before the 3 new rows
    lin = [ops.stream_linear_pack(torch.randn(n, k, generator=g) * 0.1) for n, k in ((32, 64), (32, 16), (64, 32),
                                                                                    (32, 32))]
    out.append(("decoder_layer_", (torch.randn(2, 3, 64, generator=g), None, 0.0,
                                   torch.rand(32, generator=g) + 0.5, 1e-5,
                                   [t for w in lin for t in (w, torch.empty(0))], [32, 32, 64, 32],
                                   torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g),
                                   torch.tensor([4, 0]), torch.ones(2, 3, 5, dtype=torch.bool), 0.35,
                                   torch.empty(2, 3, 32), torch.randn(2, 11, 1, 8, generator=g),
                                   torch.randn(2, 11, 1, 8, generator=g), torch.randn(2, 3, 32, generator=g))))
    # ... with Q, K, V and gate, up as separate calls (7 linears)
    lin = [ops.stream_linear_pack(torch.randn(n, k, generator=g) * 0.1) for n, k in (
        (16, 32), (8, 32), (8, 32), (32, 16), (32, 32), (32, 32), (32, 32))]
    out.append(("decoder_layer_", (torch.randn(2, 3, 32, generator=g), torch.rand(32, generator=g) + 0.5, 1e-5,
                                   torch.rand(32, generator=g) + 0.5, 1e-5,
                                   [t for w in lin for t in (w, torch.empty(0))], [16, 8, 8, 32, 32, 32, 32],
                                   torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g),
                                   torch.tensor([4, 0]), torch.ones(2, 3, 3, dtype=torch.bool).tril(), 0.35,
                                   torch.empty(2, 3, 32), torch.randn(2, 9, 1, 8, generator=g),
                                   torch.randn(2, 9, 1, 8, generator=g))))
    # decoder_layers_: two such layers (the second with Q, K, V as separate calls), their caches
    # stacked, the hidden states entering layer 1 and leaving layer 1 tapped
    lin = [ops.stream_linear_pack(torch.randn(n, k, generator=g) * 0.1) for n, k in (
        (32, 32), (32, 16), (64, 32), (32, 32), (16, 32), (8, 32), (8, 32), (32, 16), (64, 32), (32, 32))]
    out.append(("decoder_layers_", (torch.randn(2, 3, 32, generator=g),
                                    [torch.rand(32, generator=g) + 0.5 for _ in range(4)], [1e-5, 1e-6, 1e-5, 1e-6],
                                    [t for w in lin for t in (w, torch.empty(0))], [32, 32, 64, 32, 16, 8, 8, 32, 64, 32],
                                    [4, 6], torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g),
                                    torch.tensor([4, 0]), torch.ones(2, 3, 3, dtype=torch.bool).tril(), 0.35, [1, 2],
                                    torch.empty(2, 3, 32), torch.empty(2, 3, 64),
                                    torch.randn(2, 2, 9, 1, 8, generator=g), torch.randn(2, 2, 9, 1, 8, generator=g))))
    # corpus_lookup: a small corpus and its suffix order (heterospec.datastore builds it)
    from heterospec.datastore import SEP, CorpusIndex

    index = CorpusIndex([1, 2, 3, 4, 5, SEP, 1, 2, 3, 4, 6, SEP, 2, 3, 4, 5, SEP])
    out.append(("corpus_lookup", (index._tokens.clone(), index._order.clone(), torch.tensor([9, 2, 3, 4]), 3, 2, 16, 8,
                                  0.5)))
    # greedy_tokens: rows of logits with a tie
    logits = torch.randn(3, 40, generator=g)
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1.0
    out.append(("greedy_tokens", (logits,)))
    # sample_tokens: the same rows, a uniform each, temperature, top-k and top-p
    out.append(("sample_tokens", (logits, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64), 0.8, 5, 0.9)))
    return [(name, tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)) for name, args in out]


def test_samples_cover_every_op():
    assert {name for name, _ in samples("cpu")} == set(ops.OP_NAMES)


@pytest.mark.parametrize("idx", range(25))
def test_opcheck(devices, idx):
    if devices != "cpu" and samples("cpu")[idx][0] in ops.CPU_ONLY_OPS:
        pytest.skip("a CPU-only op (no CUDA kernel)")
    name, args = samples(devices)[idx]
    torch.library.opcheck(getattr(raw, name).default, args)


@pytest.mark.compile
def test_torch_compile_fullgraph_round():
    """A draft-select-build-verify-compact round compiles into one graph and matches eager."""
    torch._dynamo.reset()
    B, C, max_nodes, V, S = 3, 16, 6, 11, 32
    scores, parents = random_candidates(B, C, mode="monotone")
    budgets = torch.tensor([6, 2, 4])
    prefix_lens = torch.tensor([3, 0, 7])
    logits = torch.randn(B * (max_nodes + 1), V)

    def round_(logits, scores, parents, budgets, prefix_lens, k_cache, v_cache):
        lp, ids, h = ops.topk_entropy(logits, 2)
        cand, tree_parents, num_nodes = ops.select_tree_nodes(scores, parents, budgets, max_nodes)
        tree_mask, positions, fc, ns = ops.build_tree(tree_parents, num_nodes, prefix_lens)
        dense = ops.dense_tree_attention_mask(tree_mask, prefix_lens, S)
        tokens = cand.clamp(min=0) % V
        target = ids[:, 0].reshape(B, max_nodes + 1)
        path, alen, bonus = ops.verify_greedy(tokens, target, fc, ns, num_nodes)
        ops.compact_kv_(k_cache, v_cache, path, alen, prefix_lens)
        return h, dense, positions, path, alen, bonus

    kc, vc = torch.randn(1, B, S, 1, 2), torch.randn(1, B, S, 1, 2)
    kc2, vc2 = kc.clone(), vc.clone()
    eager = round_(logits, scores, parents, budgets, prefix_lens, kc, vc)
    compiled = torch.compile(round_, fullgraph=True)(logits, scores, parents, budgets, prefix_lens, kc2, vc2)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
