// CUDA launchers of the draft-side ops (docs/design.md, ops 1-6): topk_entropy,
// entropy_bin_policy, select_tree_nodes, build_tree, tree_attention_mask,
// dense_tree_attention_mask. Kernels and schedules: kernels/topk_entropy.cuh, kernels/bin_policy.cuh,
// kernels/tree.cuh (torch-free). One translation unit on purpose: each torch-including .cu costs
// ~45-90 s of nvcc time on a 2-core box, mostly parsing torch headers (host and device passes).
// Metadata checks are shared with the CPU ops (op_checks.h); value checks that need the data
// raise only on the CPU (a device sync otherwise) and are flagged in the outputs or handled
// memory-safely instead, as documented in the kernel headers.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "kernels/bin_policy.cuh"
#include "kernels/topk_entropy.cuh"
#include "kernels/tree.cuh"
#include "op_checks.h"
#include "ops.h"

namespace heterospec {
namespace {

void check_grid_batch(const char* op, int64_t B) {
  HS_CHECK(B <= 65535, op, ": the CUDA kernel supports B <= 65535 requests, got B = ", B);
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace

// logits [M, V] float32/float16/bfloat16 (any row stride); parent_entropy [M] float32 or None.
// -> topk_logprobs [M, k] float32, topk_ids [M, k] int64, path_entropy [M] float32.
std::tuple<Tensor, Tensor, Tensor> topk_entropy_cuda(const Tensor& logits_in, int64_t k,
                                                     const std::optional<Tensor>& parent_entropy) {
  constexpr const char* op = "topk_entropy";
  check_topk_logits(Backend::CUDA, op, logits_in, k, cuda::kTopkMaxK);
  const int64_t M = logits_in.size(0), V = logits_in.size(1);
  HS_CHECK(V <= cuda::kTopkMaxVocab && cuda::topk_num_chunks(V, logits_in.element_size()) <= 65535, op,
           ": the CUDA kernel supports V <= ",
           std::min<int64_t>(cuda::kTopkMaxVocab, 65535LL * cuda::topk_chunk_elems(logits_in.element_size())),
           ", got V = ", V);
  HS_CHECK(M <= 0x7fffffffLL, op, ": the CUDA kernel supports M < 2^31, got M = ", M);
  Tensor parent_c;
  if (parent_entropy.has_value() && parent_entropy->defined()) {
    check_parent_entropy(op, *parent_entropy, logits_in);
    parent_c = parent_entropy->contiguous();
  }
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const Tensor logits = (logits_in.stride(1) == 1 || V <= 1) ? logits_in : logits_in.contiguous();
  auto lp = at::empty({M, k}, logits.options().dtype(at::kFloat));
  auto ids = at::empty({M, k}, logits.options().dtype(at::kLong));
  auto h = at::empty({M}, logits.options().dtype(at::kFloat));
  if (M == 0) return {lp, ids, h};

  const int elem = static_cast<int>(logits.element_size());
  cuda::TopkParams p;
  p.logits = logits.const_data_ptr();
  p.row_stride = logits.stride(0);
  p.M = static_cast<int>(M);
  p.V = static_cast<int>(V);
  p.k = static_cast<int>(k);
  p.parent_entropy = parent_c.defined() ? parent_c.const_data_ptr<float>() : nullptr;
  p.out_logprobs = lp.mutable_data_ptr<float>();
  p.out_ids = ids.mutable_data_ptr<int64_t>();
  p.out_entropy = h.mutable_data_ptr<float>();
  const bool vec_ok = reinterpret_cast<uintptr_t>(p.logits) % 16 == 0 && (M == 1 || (p.row_stride * elem) % 16 == 0);
  const size_t ws_bytes = cuda::topk_workspace_bytes(M, V, k, elem);
  Tensor ws;
  if (ws_bytes > 0) ws = at::empty({static_cast<int64_t>(ws_bytes)}, logits.options().dtype(at::kByte));
  void* ws_ptr = ws.defined() ? ws.mutable_data_ptr() : nullptr;

  cuda::StreamLauncher launch{current_stream()};
  switch (logits.scalar_type()) {
    case at::kFloat: cuda::topk_entropy_run<float>(p, vec_ok, ws_ptr, launch); break;
    case at::kHalf: cuda::topk_entropy_run<__half>(p, vec_ok, ws_ptr, launch); break;
    case at::kBFloat16: cuda::topk_entropy_run<__nv_bfloat16>(p, vec_ok, ws_ptr, launch); break;
    default: TORCH_INTERNAL_ASSERT(false, "unreachable");
  }
  C10_CUDA_CHECK(launch.error);
  return {lp, ids, h};
}

// path_entropy [B] float32; bin_edges [nb-1] float32 ascending; bin_extra_depth, bin_budget [nb]
// int64. -> bins, extra_depth, budget: [B] int64.
std::tuple<Tensor, Tensor, Tensor> entropy_bin_policy_cuda(const Tensor& path_entropy, const Tensor& bin_edges,
                                                           const Tensor& bin_extra_depth, const Tensor& bin_budget) {
  constexpr const char* op = "entropy_bin_policy";
  check_bin_policy_inputs(Backend::CUDA, op, path_entropy, bin_edges, bin_extra_depth, bin_budget);
  const int64_t B = path_entropy.size(0), ne = bin_edges.size(0);
  const c10::cuda::CUDAGuard guard(path_entropy.device());
  const Tensor h = path_entropy.contiguous(), e = bin_edges.contiguous();
  const Tensor xd = bin_extra_depth.contiguous(), bb = bin_budget.contiguous();
  auto bins = at::empty({B}, h.options().dtype(at::kLong));
  auto depth = at::empty({B}, h.options().dtype(at::kLong));
  auto budget = at::empty({B}, h.options().dtype(at::kLong));
  cuda::BinPolicyParams p;
  p.path_entropy = h.const_data_ptr<float>();
  p.edges = e.const_data_ptr<float>();
  p.extra_depth_table = xd.const_data_ptr<int64_t>();
  p.budget_table = bb.const_data_ptr<int64_t>();
  p.B = B;
  p.num_edges = ne;
  p.bins = bins.mutable_data_ptr<int64_t>();
  p.extra_depth = depth.mutable_data_ptr<int64_t>();
  p.budget = budget.mutable_data_ptr<int64_t>();
  cuda::StreamLauncher launch{current_stream()};
  cuda::entropy_bin_policy_run(p, launch);
  C10_CUDA_CHECK(launch.error);
  return {bins, depth, budget};
}

// scores [B, C] float32 (-inf = invalid), parents [B, C] int64 (-1 = root), budgets [B] int64.
// -> tree_cand [B, T], tree_parents [B, T], num_nodes [B] (T = max_nodes + 1), all int64.
std::tuple<Tensor, Tensor, Tensor> select_tree_nodes_cuda(const Tensor& scores_in, const Tensor& parents_in,
                                                          const Tensor& budgets_in, int64_t max_nodes) {
  constexpr const char* op = "select_tree_nodes";
  check_select_inputs(Backend::CUDA, op, scores_in, parents_in, budgets_in, max_nodes);
  const int64_t B = scores_in.size(0), C = scores_in.size(1);
  HS_CHECK(B <= std::numeric_limits<int32_t>::max(), op, ": the CUDA kernel supports B < 2^31, got ", B);
  HS_CHECK(C <= (1LL << 27), op, ": the CUDA kernel supports C <= 2^27 candidates, got ", C);
  HS_CHECK(max_nodes < std::numeric_limits<int32_t>::max(), op, ": max_nodes too large: ", max_nodes);
  const int64_t T = max_nodes + 1;

  const c10::cuda::CUDAGuard guard(scores_in.device());
  const Tensor scores = scores_in.contiguous(), parents = parents_in.contiguous(), budgets = budgets_in.contiguous();
  auto opts = scores.options().dtype(at::kLong);
  auto tree_cand = at::empty({B, T}, opts);  // every entry is written by the kernel
  auto tree_parents = at::empty({B, T}, opts);
  auto num_nodes = at::empty({B}, opts);
  if (B == 0) return {tree_cand, tree_parents, num_nodes};

  Tensor ws;
  cuda::SelectParams p;
  p.scores = scores.const_data_ptr<float>();
  p.parents = parents.const_data_ptr<int64_t>();
  p.budgets = budgets.const_data_ptr<int64_t>();
  p.B = B;
  p.C = static_cast<int>(C);
  p.max_nodes = max_nodes;
  p.tree_cand = tree_cand.mutable_data_ptr<int64_t>();
  p.tree_parents = tree_parents.mutable_data_ptr<int64_t>();
  p.num_nodes = num_nodes.mutable_data_ptr<int64_t>();
  p.workspace = nullptr;
  if (C > cuda::kSelectSmemMaxC) {
    ws = at::empty({B * static_cast<int64_t>(cuda::select_scratch_bytes(C))}, scores.options().dtype(at::kByte));
    p.workspace = static_cast<unsigned char*>(ws.mutable_data_ptr());
  }
  cuda::StreamLauncher launch{current_stream()};
  cuda::select_tree_nodes_run(p, launch);
  C10_CUDA_CHECK(launch.error);
  return {tree_cand, tree_parents, num_nodes};
}

// tree_parents [B, T] int64, num_nodes [B] int64, prefix_lens [B] int64.
// -> tree_mask [B, T, T] bool, positions / first_child / next_sibling [B, T] int64.
std::tuple<Tensor, Tensor, Tensor, Tensor> build_tree_cuda(const Tensor& tree_parents_in, const Tensor& num_nodes_in,
                                                           const Tensor& prefix_lens_in) {
  constexpr const char* op = "build_tree";
  check_build_tree_inputs(Backend::CUDA, op, tree_parents_in, num_nodes_in, prefix_lens_in);
  const int64_t B = tree_parents_in.size(0), T = tree_parents_in.size(1);
  HS_CHECK(B * T * T < (1LL << 40), op, ": tree_mask too large for the CUDA kernel: B = ", B, ", T = ", T);

  const c10::cuda::CUDAGuard guard(tree_parents_in.device());
  const Tensor parents = tree_parents_in.contiguous(), num_nodes = num_nodes_in.contiguous();
  const Tensor prefix_lens = prefix_lens_in.contiguous();
  auto opts = parents.options();
  auto tree_mask = at::empty({B, T, T}, opts.dtype(at::kBool));  // fully written by the kernel
  auto positions = at::empty({B, T}, opts);
  auto first_child = at::empty({B, T}, opts);
  auto next_sibling = at::empty({B, T}, opts);
  cuda::BuildTreeParams p;
  p.parents = parents.const_data_ptr<int64_t>();
  p.num_nodes = num_nodes.const_data_ptr<int64_t>();
  p.prefix_lens = prefix_lens.const_data_ptr<int64_t>();
  p.B = B;
  p.T = T;
  p.tree_mask = tree_mask.mutable_data_ptr<bool>();
  p.positions = positions.mutable_data_ptr<int64_t>();
  p.first_child = first_child.mutable_data_ptr<int64_t>();
  p.next_sibling = next_sibling.mutable_data_ptr<int64_t>();
  cuda::StreamLauncher launch{current_stream()};
  cuda::build_tree_run(p, launch);
  C10_CUDA_CHECK(launch.error);
  return {tree_mask, positions, first_child, next_sibling};
}

// tree_mask [B, T, T] bool, num_nodes [B], prefix_lens [B] int64; mask_numel = sum n_b (L_b + n_b).
// -> custom_mask [mask_numel] bool (FlashInfer ragged layout), mask_indptr [B + 1] int64.
// mask_numel cannot be compared with the data-dependent total without a sync: the kernel clips
// its writes to mask_numel, and callers that want the check compare mask_indptr[-1] with it.
std::tuple<Tensor, Tensor> tree_attention_mask_cuda(const Tensor& tree_mask_in, const Tensor& num_nodes_in,
                                                    const Tensor& prefix_lens_in, int64_t mask_numel) {
  constexpr const char* op = "tree_attention_mask";
  check_tree_attention_mask_inputs(Backend::CUDA, op, tree_mask_in, num_nodes_in, prefix_lens_in);
  const int64_t B = tree_mask_in.size(0), T = tree_mask_in.size(1);
  HS_CHECK(mask_numel >= 0, op, ": expected mask_numel >= 0, got ", mask_numel);
  check_grid_batch(op, B);
  HS_CHECK(T <= std::numeric_limits<int32_t>::max(), op, ": T too large: ", T);

  const c10::cuda::CUDAGuard guard(tree_mask_in.device());
  const Tensor tree_mask = tree_mask_in.contiguous(), num_nodes = num_nodes_in.contiguous();
  const Tensor prefix_lens = prefix_lens_in.contiguous();
  auto custom_mask = at::empty({mask_numel}, tree_mask.options());
  if (B == 0 || T == 0) return {custom_mask, at::zeros({B + 1}, num_nodes.options())};
  auto indptr = at::empty({B + 1}, num_nodes.options());
  cuda::TreeAttnMaskParams p;
  p.tree_mask = tree_mask.const_data_ptr<bool>();
  p.num_nodes = num_nodes.const_data_ptr<int64_t>();
  p.prefix_lens = prefix_lens.const_data_ptr<int64_t>();
  p.B = B;
  p.T = T;
  p.mask_numel = mask_numel;
  p.custom_mask = custom_mask.mutable_data_ptr<bool>();
  p.mask_indptr = indptr.mutable_data_ptr<int64_t>();
  cuda::StreamLauncher launch{current_stream()};
  cuda::tree_attention_mask_run(p, launch);
  C10_CUDA_CHECK(launch.error);
  return {custom_mask, indptr};
}

// tree_mask [B, T, T] bool, prefix_lens [B] int64, width >= max_b L_b + T.
// -> [B, T, width] bool: prefix columns true, tree columns from tree_mask, the rest false.
Tensor dense_tree_attention_mask_cuda(const Tensor& tree_mask_in, const Tensor& prefix_lens_in, int64_t width) {
  constexpr const char* op = "dense_tree_attention_mask";
  check_dense_mask_inputs(Backend::CUDA, op, tree_mask_in, prefix_lens_in, width);
  const int64_t B = tree_mask_in.size(0), T = tree_mask_in.size(1);
  check_grid_batch(op, B);
  HS_CHECK(T <= std::numeric_limits<int32_t>::max(), op, ": T too large: ", T);

  const c10::cuda::CUDAGuard guard(tree_mask_in.device());
  const Tensor tree_mask = tree_mask_in.contiguous(), prefix_lens = prefix_lens_in.contiguous();
  auto out = at::empty({B, T, width}, tree_mask.options());  // every byte is written by the kernel
  cuda::DenseMaskParams p;
  p.tree_mask = tree_mask.const_data_ptr<bool>();
  p.prefix_lens = prefix_lens.const_data_ptr<int64_t>();
  p.B = B;
  p.T = T;
  p.width = width;
  p.out = out.mutable_data_ptr<bool>();
  cuda::StreamLauncher launch{current_stream()};
  cuda::dense_tree_attention_mask_run(p, launch);
  C10_CUDA_CHECK(launch.error);
  return out;
}

TORCH_LIBRARY_IMPL(heterospec, CUDA, m) {
  m.impl("topk_entropy", &topk_entropy_cuda);
  m.impl("entropy_bin_policy", &entropy_bin_policy_cuda);
  m.impl("select_tree_nodes", &select_tree_nodes_cuda);
  m.impl("build_tree", &build_tree_cuda);
  m.impl("tree_attention_mask", &tree_attention_mask_cuda);
  m.impl("dense_tree_attention_mask", &dense_tree_attention_mask_cuda);
}

}  // namespace heterospec
