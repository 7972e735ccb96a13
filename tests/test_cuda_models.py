"""Model tests on CUDA in bfloat16 / float16, with the sdpa and FlashInfer backends (GPU only).

The other model tests run on CPU (float32 / float64), except
test_models_target.py::test_flashinfer_matches_sdpa. Here:
  * the target against transformers (float32, CPU) on CUDA, batched prefill of ragged prompts;
  * tree verification equals sequential decoding, then compaction, on CUDA;
  * the EAGLE-3 draft's extend / tree_step on CUDA against CPU float32;
  * FlashInfer vs SDPA on a SmolLM2-shaped stack (9/3 heads: GQA ratio 3) at a longer context;
  * a verification forward captured in a CUDA graph equals the eager forward (sdpa).
FlashInfer needs head_dim 64 / 128 / 256 and fp16 / bf16; its JIT modules used here are
(bf16, 64), (fp16, 64) and (bf16, 128), the ones scripts/gpu_fi_warm.py compiles ahead.
"""

from __future__ import annotations

import pytest
import torch

import heterospec
from heterospec.models import Eagle3Draft, TargetModel
from heterospec.models.attention import flashinfer_available
from models_util import llama3_rope_scaling, path_to, random_parents, tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Max abs error allowed, as a fraction of the reference's largest magnitude (>= 1). Measured with
# these configs in CPU bf16 / fp16 against float32: at most 3.3% / 0.43% of max |logit|.
REL = {torch.bfloat16: 0.06, torch.float16: 0.012}
CONFIGS = {
    "hd64_gqa3": dict(vocab=131, hidden=384, layers=3, heads=6, kv_heads=2, tied=True),
    "hd128_llama3": dict(vocab=89, hidden=512, layers=3, heads=4, kv_heads=1, rope_theta=500000.0,
                         rope_scaling=llama3_rope_scaling(16)),
}
_BF, _FP = torch.bfloat16, torch.float16
CASES = [(c, d, b) for c in CONFIGS for d in (_BF, _FP) for b in ("sdpa", "flashinfer")
         if not (c == "hd128_llama3" and d == _FP and b == "flashinfer")]   # not warmed ahead: skip its JIT


def _close(actual, expected, dtype, what=""):
    actual, expected = actual.float().cpu(), expected.float().cpu()
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err = (actual - expected).abs().max().item()
    bound = REL[dtype] * max(1.0, expected.abs().max().item())
    assert err <= bound, f"{what}: max abs error {err:.4g} > {bound:.4g} ({dtype})"


def _backend_or_skip(backend):
    if backend == "flashinfer" and not flashinfer_available():
        pytest.skip("flashinfer is not installed")


def _i64(*xs, device="cuda"):
    return torch.tensor(xs, dtype=torch.long, device=device)



def _hf_logits(hf, seq):
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0].float()


def _prefill(tm, prompts, S):
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
    cache = tm.new_cache(B, S)
    zeros = torch.zeros(B, dtype=torch.long, device="cuda")
    with torch.inference_mode():
        logits, _ = tm(ids.cuda(), torch.arange(P, device="cuda").expand(B, P), cache, zeros,
                       num_nodes=_i64(*[len(p) for p in prompts]))
    return logits, cache


@pytest.mark.parametrize("name,dtype,backend", CASES)
def test_target_matches_transformers(name, dtype, backend):
    _backend_or_skip(backend)
    hf = tiny_llama(seed=1, **CONFIGS[name])
    tm = TargetModel.from_hf(hf, device="cuda", dtype=dtype, attn_backend=backend)
    assert tm.backend.name == backend and tm.dtype == dtype
    gen = torch.Generator().manual_seed(2)
    V = hf.config.vocab_size
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (23, 5, 14)]
    logits, _ = _prefill(tm, prompts, 48)
    for b, p in enumerate(prompts):
        _close(logits[b, :len(p)], _hf_logits(hf, p), dtype, f'prefill {b}')


@pytest.mark.parametrize("name,dtype,backend", CASES)
def test_tree_verification_sequential_and_compaction(name, dtype, backend):
    _backend_or_skip(backend)
    hf = tiny_llama(seed=6, **CONFIGS[name])
    tm = TargetModel.from_hf(hf, device="cuda", dtype=dtype, attn_backend=backend)
    gen = torch.Generator().manual_seed(7)
    V = hf.config.vocab_size
    B, T, S = 3, 9, 48
    num_nodes = [9, 6, 1]  # request 2: a lone root (plain decode) inside a padded batch
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (5, 11, 8)]
    _, cache = _prefill(tm, prompts, S)
    prefix = _i64(*[len(p) for p in prompts])
    parents = torch.full((B, T), -1, dtype=torch.long)
    plists = []
    for b, n in enumerate(num_nodes):
        plists.append(random_parents(n, gen))
        parents[b, :n] = torch.tensor(plists[-1])
    nn_ = _i64(*num_nodes)
    tree_mask, positions, _, _ = heterospec.build_tree(parents.cuda(), nn_, prefix)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    with torch.inference_mode():
        t_logits, _ = tm(tokens.cuda(), positions, cache, prefix, tree_mask, nn_)
    for b in range(B):
        for i in range(num_nodes[b]):
            seq = prompts[b] + tokens[b, path_to(plists[b], i)].tolist()
            _close(t_logits[b, i], _hf_logits(hf, seq)[-1], dtype, f'tree node {b}/{i}')
    # accept the path to the deepest node, compact, then decode 3 more tokens
    accept_path = torch.full((B, T), -1, dtype=torch.long)
    accept_len = torch.zeros(B, dtype=torch.long)
    accepted = []
    for b, n in enumerate(num_nodes):
        deepest = max(range(n), key=lambda i: (len(path_to(plists[b], i)), i))
        path = path_to(plists[b], deepest)
        accept_path[b, :len(path)] = torch.tensor(path)
        accept_len[b] = len(path) - 1
        accepted.append(tokens[b, path].tolist())
    cache.compact(accept_path.cuda(), accept_len.cuda(), prefix)
    new_prefix = prefix + accept_len.cuda() + 1
    more = torch.randint(0, V, (B, 3), generator=gen)
    with torch.inference_mode():
        c_logits, _ = tm(more.cuda(), new_prefix[:, None] + torch.arange(3, device="cuda"), cache, new_prefix)
    for b in range(B):
        ref = _hf_logits(hf, prompts[b] + accepted[b] + more[b].tolist())[-3:]
        _close(c_logits[b], ref, dtype, f'after compaction {b}')


@pytest.mark.parametrize("dtype", [_BF, _FP])
def test_draft_extend_and_tree_step_match_cpu(dtype):
    hf = tiny_llama(seed=3, **CONFIGS["hd64_gqa3"])
    outs = []
    for dev, dt in (("cpu", torch.float32), ("cuda", dtype)):
        target = TargetModel.from_hf(hf, device=dev, dtype=dt)
        draft = Eagle3Draft.for_target(target, draft_vocab_size=60, seed=4)  # same seed: same weights
        gen = torch.Generator().manual_seed(5)
        B, n, H, k = 2, 5, hf.config.hidden_size, 3
        ids = torch.randint(0, 131, (B, n), generator=gen).to(dev)
        feats = (torch.randn(B, n, 3 * H, generator=gen) * 0.5).to(dev, dt)
        cache = draft.new_cache(B, 32)
        prefix, num_new = _i64(0, 0, device=dev), _i64(5, 3, device=dev)
        with torch.inference_mode():
            h = draft.extend(ids, feats, cache, prefix, num_new)
            root = h[torch.arange(B, device=dev), num_new - 1]
            state = draft.new_tree(B)
            toks = torch.randint(0, 131, (B, k), generator=gen).to(dev)
            pos = num_new[:, None].expand(B, k)
            h1 = draft.tree_step(toks, root[:, None].expand(B, k, H), torch.full((B, k), -1, device=dev), pos, cache,
                                 num_new, state)
            h2 = draft.tree_step(toks.flip(1), h1, _i64(0, 0, 2, device=dev).expand(B, k), pos + 1, cache, num_new,
                                 state)
            outs.append([x.float().cpu() for x in (h[0, :5], h[1, :3], h1, h2, draft.logits(h2))])
    for i, (a, b) in enumerate(zip(*outs)):
        _close(b, a, dtype, f"draft output {i}")


@pytest.mark.skipif(not flashinfer_available(), reason="flashinfer is not installed")
def test_flashinfer_matches_sdpa_smollm2_shape():
    """SmolLM2-135M head layout (9 query / 3 KV heads of 64), two layers, bf16, 60-node trees."""
    hf = tiny_llama(seed=8, vocab=4096, hidden=576, layers=2, heads=9, kv_heads=3, intermediate=1536, tied=True)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (300, 17, 1)]
    B, T = 3, 60
    num_nodes = [60, 22, 1]
    parents = torch.full((B, T), -1, dtype=torch.long)
    for b, n in enumerate(num_nodes):
        parents[b, :n] = torch.tensor(random_parents(n, gen))
    toks = torch.randint(0, 4096, (B, T), generator=gen).cuda()
    outs = []
    for backend in ("flashinfer", "sdpa"):
        tm = TargetModel.from_hf(hf, device="cuda", dtype=_BF, attn_backend=backend)
        pf, cache = _prefill(tm, prompts, 400)
        prefix = _i64(*[len(p) for p in prompts])
        mask, pos, _, _ = heterospec.build_tree(parents.cuda(), _i64(*num_nodes), prefix)
        with torch.inference_mode():
            outs.append((pf, tm(toks, pos, cache, prefix, mask, _i64(*num_nodes))))
    (pf_a, (lg_a, ft_a)), (pf_b, (lg_b, ft_b)) = outs
    for b, (p, n) in enumerate(zip(prompts, num_nodes)):
        _close(pf_a[b, :len(p)], pf_b[b, :len(p)], _BF, f"prefill {b}")
        _close(lg_a[b, :n], lg_b[b, :n], _BF, f"tree logits {b}")
        _close(ft_a[b, :n], ft_b[b, :n], _BF, f"tree features {b}")


def test_cuda_graph_replay_of_verification_forward():
    """The premise of docs/gpu.md: a tree-verification forward (sdpa) captures and replays."""
    hf = tiny_llama(seed=11, **CONFIGS["hd64_gqa3"])
    tm = TargetModel.from_hf(hf, device="cuda", dtype=_BF, attn_backend="sdpa")
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 131, (n,), generator=gen).tolist() for n in (20, 9)]
    _, cache = _prefill(tm, prompts, 64)
    B, T = 2, 8

    def inputs():
        parents = torch.stack([torch.tensor(random_parents(T, gen)) for _ in range(B)]).cuda()
        prefix = _i64(*[len(p) for p in prompts])
        mask, pos, _, _ = heterospec.build_tree(parents, _i64(T, T), prefix)
        return [torch.randint(0, 131, (B, T), generator=gen).cuda(), pos, prefix, mask, _i64(T, T)]

    static = inputs()
    fwd = lambda a: tm(a[0], a[1], cache, a[2], a[3], a[4])  # noqa: E731
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fwd(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_logits, g_feats = fwd(static)
        fresh = inputs()
        for s, f in zip(static, fresh):
            s.copy_(f)
        k0, v0 = cache.k.clone(), cache.v.clone()
        graph.replay()
        torch.cuda.synchronize()
        g_logits, g_feats, g_k = g_logits.clone(), g_feats.clone(), cache.k.clone()
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        e_logits, e_feats = fwd(fresh)
    torch.testing.assert_close(g_logits, e_logits, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(g_feats.float(), e_feats.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(g_k, cache.k)   # the replay wrote the tree's K rows where eager does


# ---------------------------------------------------------------------------------------------
# Premises of the CUDA-graph design (docs/gpu.md) for FlashInfer
# ---------------------------------------------------------------------------------------------
def _pack_little(blocks):
    """Bool [T, kv_b] blocks -> packed uint8 (little bit order, each block padded to a byte) and the
    byte-unit indptr (what FlashInfer's plan computes from a bool mask)."""
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32)
    out, indptr = [], [0]
    for blk in blocks:
        bits = blk.flatten().to(torch.int32)
        bits = torch.cat([bits, bits.new_zeros((-bits.numel()) % 8)]).view(-1, 8)
        out.append((bits * weights).sum(1).to(torch.uint8))
        indptr.append(indptr[-1] + out[-1].numel())
    return torch.cat(out), indptr


def _graph_wrapper(B, bytes_max):
    import flashinfer

    i32 = dict(dtype=torch.int32, device="cuda")
    bufs = dict(qo_indptr_buf=torch.zeros(B + 1, **i32), paged_kv_indptr_buf=torch.zeros(B + 1, **i32),
                paged_kv_indices_buf=torch.zeros(B, **i32), paged_kv_last_page_len_buf=torch.zeros(B, **i32),
                custom_mask_buf=torch.zeros(bytes_max, dtype=torch.uint8, device="cuda"),
                mask_indptr_buf=torch.zeros(B + 1, **i32))
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, backend="fa2", **bufs), bufs


@pytest.mark.skipif(not flashinfer_available(), reason="flashinfer is not installed")
def test_flashinfer_graph_mode_replay_after_replanning():
    """Plan on the host (pinned tensors), capture run() once, then for new prefix lengths (same tree
    width) re-plan, fix mask_indptr to byte units (FlashInfer leaves a packed mask's indptr in
    element units: wrong for requests > 0) and replay: equals a float32 SDPA reference.
    Also reports (xfail) whether plan() makes a torch-visible host sync."""
    import torch.nn.functional as F

    B, T, S, Hq, Hkv, D = 2, 22, 256, 9, 3, 64
    gen = torch.Generator().manual_seed(13)
    k = torch.randn(B, S, Hkv, D, generator=gen).cuda().to(_BF)
    v = torch.randn(B, S, Hkv, D, generator=gen).cuda().to(_BF)
    q = torch.zeros(B * T, Hq, D, dtype=_BF, device="cuda")
    wrapper, bufs = _graph_wrapper(B, B * (-(-T * S // 8) + 1))
    pin = lambda xs: torch.tensor(xs, dtype=torch.int32).pin_memory()  # noqa: E731

    def plan(prefix):
        blocks = []
        for L in prefix:
            tm = torch.zeros(T, T, dtype=torch.bool)
            parents = random_parents(T, gen)
            for i in range(T):
                for j in path_to(parents, i):
                    tm[i, j] = True
            blocks.append(torch.cat([torch.ones(T, L, dtype=torch.bool), tm], 1))
        packed, byte_indptr = _pack_little(blocks)
        kv = [L + T for L in prefix]
        # every host-to-device copy from pinned memory and asynchronous: no host sync
        packed = packed.pin_memory().to("cuda", non_blocking=True)
        wrapper.plan(pin([0, T, 2 * T]), pin(list(range(B + 1))), pin(list(range(B))), pin(kv), Hq, Hkv, D, S,
                     packed_custom_mask=packed, q_data_type=_BF, kv_data_type=_BF, sm_scale=D**-0.5)
        bufs["mask_indptr_buf"].copy_(pin(byte_indptr), non_blocking=True)
        return blocks

    def reference(blocks):
        outs = []
        for b, blk in enumerate(blocks):
            W = blk.shape[1]
            qb = q[b * T:(b + 1) * T].float().transpose(0, 1)
            kb = k[b, :W].float().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
            vb = v[b, :W].float().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
            outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=blk.cuda(), scale=D**-0.5).transpose(0, 1))
        return torch.cat(outs)

    plan([100, 37])
    q.copy_(torch.randn(B * T, Hq, D, generator=gen).to(_BF))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapper.run(q, (k, v))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = wrapper.run(q, (k, v))
    for prefix in ([100, 37], [140, 60], [3, 201]):
        blocks = plan(prefix)
        q.copy_(torch.randn(B * T, Hq, D, generator=gen).to(_BF))
        graph.replay()
        torch.cuda.synchronize()
        err = (out.float() - reference(blocks)).abs().max().item()
        assert err < 2e-2, f"graph replay after re-planning for prefixes {prefix}: max abs error {err}"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan([120, 80])
    except RuntimeError as exc:
        pytest.xfail(f"FlashInfer plan() from pinned host tensors synchronises: {exc}")
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("friendly", [False, True])
def test_attention_never_runs_cudnn(friendly):
    """Our eager attention leaves cuDNN out on CUDA (models/layers.attention_backends): cuDNN builds a
    plan for every new shape, tens of ms each, and eager calls change shape with every prompt
    length. Checked on the kernels a profile names, over several query / key lengths."""
    from torch.profiler import ProfilerActivity, profile

    from heterospec.models.layers import sdpa, sdpa_kernel_friendly

    attend = sdpa_kernel_friendly if friendly else sdpa
    kernels = []
    for tq, tk in ((1, 37), (5, 64), (53, 53), (78, 130)):
        q = torch.randn(1, tq, 8, 64, device="cuda", dtype=_BF)
        k, v = (torch.randn(1, tk, 8, 64, device="cuda", dtype=_BF) for _ in range(2))
        mask = torch.ones(tq, tk, dtype=torch.bool, device="cuda").tril(tk - tq)[None]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = attend(q, k, v, mask, 0.125)
            torch.cuda.synchronize()
        ref = torch.softmax((q.float().transpose(1, 2) @ k.float().transpose(1, 2).transpose(-1, -2)) * 0.125
                            + torch.zeros(mask.shape, device="cuda").masked_fill(~mask, float("-inf"))[:, None],
                            dim=-1) @ v.float().transpose(1, 2)
        _close(out, ref.transpose(1, 2), _BF, f"attention {tq}x{tk}")
        kernels += [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels, "the profiler saw no CUDA kernel"
    assert not [n for n in kernels if "cudnn" in n.lower()], sorted({n for n in kernels if "cudnn" in n.lower()})
