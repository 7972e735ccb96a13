// C entry points that run heterospec's CUDA kernels on the host SIMT emulator (simt_emu.h), one per
// op, with the same decisions as the launchers in csrc/cuda/*.cu (vector paths, workspaces, copy
// units) but on raw host pointers. Loaded with ctypes by tests/cuda_host/emu_backend.py so the
// CUDA parity tests (tests/test_ops_cuda_parity.py) can run the kernels without a GPU.
//   g++ -std=c++20 -O1 -shared -fPIC -I csrc -I <cuda>/include tests/cuda_host/emu_ops.cpp -o libhs_emu.so
// Every function returns 0, or -1 after an exception (message: hs_emu_last_error()).
#include "simt_emu.h"
// (the emulator must come first: it maps the CUDA keywords)
#include "cuda/kernels/bin_policy.cuh"
#include "cuda/kernels/kv.cuh"
#include "cuda/kernels/topk_entropy.cuh"
#include "cuda/kernels/tree.cuh"
#include "cuda/kernels/verify.cuh"

#include <string>

namespace hc = heterospec::cuda;

namespace {

std::string g_error;

auto emu_launch = [](auto kernel, dim3 grid, dim3 block, size_t smem, auto... args) {
  emu::launch(kernel, grid, block, smem, args...);
};

template <class F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
  } catch (...) {
    g_error = "unknown exception";
  }
  return -1;
}

// 16-byte aligned scratch.
struct Scratch {
  std::vector<unsigned char> buf;
  void* get(size_t n) {
    buf.assign(n + 16, 0xAB);
    return buf.data() + (16 - reinterpret_cast<uintptr_t>(buf.data()) % 16) % 16;
  }
};

}  // namespace

extern "C" {

const char* hs_emu_last_error() { return g_error.c_str(); }

// dtype: 0 float32, 1 float16, 2 bfloat16. logits rows `row_stride` elements apart.
int hs_emu_topk_entropy(const void* logits, int dtype, int64_t M, int64_t V, int64_t row_stride, int64_t k,
                        const float* parent, float* lp, int64_t* ids, float* h) {
  return guarded([&] {
    if (M == 0) return;
    const int elem = dtype == 0 ? 4 : 2;
    hc::TopkParams p{};
    p.logits = logits;
    p.row_stride = row_stride;
    p.M = static_cast<int>(M);
    p.V = static_cast<int>(V);
    p.k = static_cast<int>(k);
    p.parent_entropy = parent;
    p.out_logprobs = lp;
    p.out_ids = ids;
    p.out_entropy = h;
    const bool vec_ok = reinterpret_cast<uintptr_t>(logits) % 16 == 0 && (M == 1 || (row_stride * elem) % 16 == 0);
    Scratch ws;
    const size_t wsb = hc::topk_workspace_bytes(M, V, k, elem);
    void* w = wsb ? ws.get(wsb) : nullptr;
    if (dtype == 0)
      hc::topk_entropy_run<float>(p, vec_ok, w, emu_launch);
    else if (dtype == 1)
      hc::topk_entropy_run<__half>(p, vec_ok, w, emu_launch);
    else
      hc::topk_entropy_run<__nv_bfloat16>(p, vec_ok, w, emu_launch);
  });
}

int hs_emu_entropy_bin_policy(const float* h, const float* edges, const int64_t* xd, const int64_t* bb, int64_t B,
                              int64_t ne, int64_t* bins, int64_t* depth, int64_t* budget) {
  return guarded([&] {
    hc::BinPolicyParams p{h, edges, xd, bb, B, ne, bins, depth, budget};
    hc::entropy_bin_policy_run(p, emu_launch);
  });
}

int hs_emu_select_tree_nodes(const float* s, const int64_t* par, const int64_t* budgets, int64_t B, int64_t C,
                             int64_t max_nodes, int64_t* tc, int64_t* tp, int64_t* nn) {
  return guarded([&] {
    hc::SelectParams p{};
    p.scores = s;
    p.parents = par;
    p.budgets = budgets;
    p.B = B;
    p.C = static_cast<int>(C);
    p.max_nodes = max_nodes;
    p.tree_cand = tc;
    p.tree_parents = tp;
    p.num_nodes = nn;
    Scratch ws;
    if (C > hc::kSelectSmemMaxC) p.workspace = static_cast<unsigned char*>(ws.get(B * hc::select_scratch_bytes(C)));
    hc::select_tree_nodes_run(p, emu_launch);
  });
}

int hs_emu_build_tree(const int64_t* par, const int64_t* n, const int64_t* L, int64_t B, int64_t T, bool* mask,
                      int64_t* pos, int64_t* fc, int64_t* ns) {
  return guarded([&] {
    hc::BuildTreeParams p{par, n, L, B, T, mask, pos, fc, ns};
    hc::build_tree_run(p, emu_launch);
  });
}

int hs_emu_tree_attention_mask(const bool* tm, const int64_t* n, const int64_t* L, int64_t B, int64_t T,
                               int64_t numel, bool* cm, int64_t* indptr) {
  return guarded([&] {
    hc::TreeAttnMaskParams p{tm, n, L, B, T, numel, cm, indptr};
    hc::tree_attention_mask_run(p, emu_launch);
  });
}

int hs_emu_dense_tree_attention_mask(const bool* tm, const int64_t* L, int64_t B, int64_t T, int64_t width,
                                     bool* out) {
  return guarded([&] {
    hc::DenseMaskParams p{tm, L, B, T, width, out};
    hc::dense_tree_attention_mask_run(p, emu_launch);
  });
}

int hs_emu_verify_greedy(const int64_t* tok, const int64_t* tgt, const int64_t* fc, const int64_t* ns,
                         const int64_t* n, int64_t B, int64_t T, int64_t* path, int64_t* alen, int64_t* bonus) {
  return guarded([&] {
    hc::VerifyGreedyParams p{{tok, fc, ns, n, B, T}, tgt, {path, alen, bonus}};
    hc::verify_greedy_run(p, emu_launch);
  });
}

int hs_emu_verify_sampling(const int64_t* tok, const float* probs, const int64_t* fc, const int64_t* ns,
                           const int64_t* n, const float* coins, const float* fcoins, int64_t B, int64_t T, int64_t V,
                           int64_t* path, int64_t* alen, int64_t* bonus) {
  return guarded([&] {
    hc::VerifySamplingParams p{{tok, fc, ns, n, B, T}, probs, V, coins, fcoins, {path, alen, bonus}};
    const bool vec4 = reinterpret_cast<uintptr_t>(probs) % 16 == 0 && V % 4 == 0;
    hc::verify_sampling_run(p, vec4, emu_launch);
  });
}

int hs_emu_compact_kv(void* k, void* v, const int64_t* path, const int64_t* alen, const int64_t* L, int64_t NL,
                      int64_t B, int64_t S, int64_t P, int64_t row_bytes) {
  return guarded([&] {
    const int unit = hc::compact_kv_unit(row_bytes, reinterpret_cast<uintptr_t>(k), reinterpret_cast<uintptr_t>(v));
    hc::CompactKvParams p{static_cast<unsigned char*>(k), static_cast<unsigned char*>(v), path, alen, L, NL, B, S, P,
                          row_bytes / unit};
    hc::compact_kv_run(p, unit, 64, emu_launch);  // few blocks: exercises the grid-stride loop
  });
}

}  // extern "C"
