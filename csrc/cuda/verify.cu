// CUDA launchers of the verification-side ops (docs/design.md, ops 7-9): verify_greedy,
// verify_sampling, compact_kv_. Kernels and schedules: kernels/verify.cuh, kernels/kv.cuh
// (torch-free). One translation unit on purpose (torch headers dominate nvcc time).
// Metadata checks are shared with the CPU ops (op_checks.h); link / token / coin / distribution /
// path values are validated only on the CPU (a device sync otherwise): the kernels follow tree
// links only forward below num_nodes, flag a target row that is not a distribution with
// bonus = -1 and the row's node at accept_path[b, accept_len[b]] (heterospec/ops.py:
// verify_sampling_invalid, raise_verify_sampling_errors), and leave a request whose accepted path the CPU op would reject untouched in
// compact_kv_.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "kernels/kv.cuh"
#include "kernels/verify.cuh"
#include "op_checks.h"
#include "ops.h"

namespace heterospec {
namespace {

cuda::VerifyTree tree_view(const TreeInputs& in) {
  cuda::VerifyTree v;
  v.tokens = in.tokens.const_data_ptr<int64_t>();
  v.first_child = in.first_child.const_data_ptr<int64_t>();
  v.next_sibling = in.next_sibling.const_data_ptr<int64_t>();
  v.num_nodes = in.num_nodes.const_data_ptr<int64_t>();
  v.B = in.B;
  v.T = in.T;
  return v;
}

}  // namespace

// tree_tokens, target_ids, first_child, next_sibling [B, T] int64; num_nodes [B] int64.
// -> accept_path [B, T] (root + accepted positions, -1 padded), accept_len [B], bonus [B]; int64.
std::tuple<Tensor, Tensor, Tensor> verify_greedy_cuda(const Tensor& tree_tokens, const Tensor& target_ids_in,
                                                      const Tensor& first_child, const Tensor& next_sibling,
                                                      const Tensor& num_nodes) {
  constexpr const char* op = "verify_greedy";
  const TreeInputs in = check_tree_inputs(Backend::CUDA, op, tree_tokens, first_child, next_sibling, num_nodes);
  check_tree_like(Backend::CUDA, op, "target_ids", target_ids_in, at::kLong, 2, in.B, in.T, tree_tokens);
  const c10::cuda::CUDAGuard guard(tree_tokens.device());
  const Tensor target_ids = target_ids_in.contiguous();
  auto opts = in.tokens.options();
  auto accept_path = at::empty({in.B, in.T}, opts);  // fully written by the kernel
  auto accept_len = at::empty({in.B}, opts);
  auto bonus = at::empty({in.B}, opts);
  cuda::VerifyGreedyParams p;
  p.tree = tree_view(in);
  p.target_ids = target_ids.const_data_ptr<int64_t>();
  p.out = {accept_path.mutable_data_ptr<int64_t>(), accept_len.mutable_data_ptr<int64_t>(),
           bonus.mutable_data_ptr<int64_t>()};
  cuda::StreamLauncher launch{c10::cuda::getCurrentCUDAStream().stream()};
  cuda::verify_greedy_run(p, launch);
  C10_CUDA_CHECK(launch.error);
  return {accept_path, accept_len, bonus};
}

// tree_tokens, first_child, next_sibling [B, T] int64; target_probs [B, T, V] float32 >= 0;
// num_nodes [B] int64; coins [B, T], final_coins [B] float32 in [0, 1).
// -> accept_path [B, T], accept_len [B], bonus [B]; int64.
std::tuple<Tensor, Tensor, Tensor> verify_sampling_cuda(const Tensor& tree_tokens, const Tensor& target_probs_in,
                                                        const Tensor& first_child, const Tensor& next_sibling,
                                                        const Tensor& num_nodes, const Tensor& coins_in,
                                                        const Tensor& final_coins_in) {
  constexpr const char* op = "verify_sampling";
  const TreeInputs in = check_tree_inputs(Backend::CUDA, op, tree_tokens, first_child, next_sibling, num_nodes);
  const int64_t V =
      check_verify_sampling_inputs(Backend::CUDA, op, in, tree_tokens, target_probs_in, coins_in, final_coins_in);
  HS_CHECK(in.B <= 0x7fffffffLL, op, ": the CUDA kernel supports B < 2^31, got ", in.B);
  // The distinct child tokens of a node and the row's segment masses live in (dynamic) shared
  // memory: T * 8 bytes + 16 bytes per 1024 vocabulary entries (rounded up to 16384).
  HS_CHECK(cuda::verify_sampling_smem_bytes(in.T, V) <= 48 * 1024, op,
           ": the CUDA kernel needs T * 8 + 16 * ceil(V / 1024) <= 49152 bytes of shared memory (T tree "
           "positions, V vocabulary entries), got T = ", in.T, ", V = ", V);

  const c10::cuda::CUDAGuard guard(tree_tokens.device());
  const Tensor probs = target_probs_in.contiguous(), coins = coins_in.contiguous();
  const Tensor final_coins = final_coins_in.contiguous();
  auto opts = in.tokens.options();
  auto accept_path = at::empty({in.B, in.T}, opts);  // fully written by the kernel
  auto accept_len = at::empty({in.B}, opts);
  auto bonus = at::empty({in.B}, opts);
  cuda::VerifySamplingParams p;
  p.tree = tree_view(in);
  p.probs = probs.const_data_ptr<float>();
  p.V = V;
  p.coins = coins.const_data_ptr<float>();
  p.final_coins = final_coins.const_data_ptr<float>();
  p.out = {accept_path.mutable_data_ptr<int64_t>(), accept_len.mutable_data_ptr<int64_t>(),
           bonus.mutable_data_ptr<int64_t>()};
  const bool vec4 = reinterpret_cast<uintptr_t>(p.probs) % 16 == 0 && V % 4 == 0;
  cuda::StreamLauncher launch{c10::cuda::getCurrentCUDAStream().stream()};
  cuda::verify_sampling_run(p, vec4, launch);
  C10_CUDA_CHECK(launch.error);
  return {accept_path, accept_len, bonus};
}

// k_cache, v_cache [num_layers, B, S, H_kv, D] (same shape, dtype, device; contiguous), written in
// place; accept_path [B, P] int64 (P >= 1), accept_len [B] int64, prefix_lens [B] int64.
void compact_kv_cuda(Tensor& k_cache, Tensor& v_cache, const Tensor& accept_path_in, const Tensor& accept_len_in,
                     const Tensor& prefix_lens_in) {
  constexpr const char* op = "compact_kv_";
  const KvDims d = check_compact_kv_inputs(Backend::CUDA, op, k_cache, v_cache, accept_path_in, accept_len_in,
                                           prefix_lens_in);
  const int64_t NL = d.num_layers, B = d.B, S = d.S, P = d.P;
  if (k_cache.numel() == 0) return;

  const c10::cuda::CUDAGuard guard(k_cache.device());
  const Tensor accept_path = accept_path_in.contiguous(), accept_len = accept_len_in.contiguous();
  const Tensor prefix_lens = prefix_lens_in.contiguous();
  const int64_t row_bytes = k_cache.size(3) * k_cache.size(4) * static_cast<int64_t>(k_cache.element_size());
  auto* kb = static_cast<unsigned char*>(k_cache.mutable_data_ptr());
  auto* vb = static_cast<unsigned char*>(v_cache.mutable_data_ptr());
  const int unit = cuda::compact_kv_unit(row_bytes, reinterpret_cast<uintptr_t>(kb), reinterpret_cast<uintptr_t>(vb));
  cuda::CompactKvParams p;
  p.k_cache = kb;
  p.v_cache = vb;
  p.accept_path = accept_path.const_data_ptr<int64_t>();
  p.accept_len = accept_len.const_data_ptr<int64_t>();
  p.prefix_lens = prefix_lens.const_data_ptr<int64_t>();
  p.num_layers = NL;
  p.B = B;
  p.S = S;
  p.P = P;
  p.row_units = row_bytes / unit;
  cuda::StreamLauncher launch{c10::cuda::getCurrentCUDAStream().stream()};
  cuda::compact_kv_run(p, unit, /*max_blocks=*/1 << 16, launch);
  C10_CUDA_CHECK(launch.error);
}

TORCH_LIBRARY_IMPL(heterospec, CUDA, m) {
  m.impl("verify_greedy", &verify_greedy_cuda);
  m.impl("verify_sampling", &verify_sampling_cuda);
  m.impl("compact_kv_", &compact_kv_cuda);
}

}  // namespace heterospec
