// CUDA launchers of the verification-side ops (docs/design.md, ops 7-9): verify_greedy,
// verify_sampling, compact_kv_. Kernels and schedules: kernels/verify.cuh, kernels/kv.cuh
// (torch-free). One translation unit on purpose (torch headers dominate nvcc time).
// Host checks mirror the CPU ops' metadata checks; link / token / coin / distribution / path
// values are validated only on the CPU (a device sync otherwise): the kernels follow tree links
// only forward below num_nodes, flag a target row that is not a distribution with bonus = -1,
// and leave a request whose accepted path the CPU op would reject untouched in compact_kv_.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <utility>

#include "checks.h"
#include "kernels/kv.cuh"
#include "kernels/verify.cuh"
#include "ops.h"

namespace heterospec {
namespace {

struct TreeInputs {
  int64_t B = 0, T = 0;
  Tensor tokens, first_child, next_sibling, num_nodes;  // contiguous
};

// [B, T] int64 tree tensors and num_nodes [B], all on tree_tokens' CUDA device.
TreeInputs check_tree_inputs(const char* op, const Tensor& tree_tokens, const Tensor& first_child,
                             const Tensor& next_sibling, const Tensor& num_nodes) {
  check_dtype(op, "tree_tokens", tree_tokens, at::kLong);
  check_dim(op, "tree_tokens", tree_tokens, 2, "[B, T]");
  check_cuda(op, "tree_tokens", tree_tokens);
  TreeInputs in;
  in.B = tree_tokens.size(0);
  in.T = tree_tokens.size(1);
  const std::pair<const char*, const Tensor*> bt[] = {{"first_child", &first_child}, {"next_sibling", &next_sibling}};
  for (const auto& [name, t] : bt) {
    check_dtype(op, name, *t, at::kLong);
    check_dim(op, name, *t, 2, "[B, T]");
    check_same_device(op, name, *t, "tree_tokens", tree_tokens);
    check_size(op, name, *t, 0, in.B, "B = tree_tokens.size(0)");
    check_size(op, name, *t, 1, in.T, "T = tree_tokens.size(1)");
  }
  check_dtype(op, "num_nodes", num_nodes, at::kLong);
  check_dim(op, "num_nodes", num_nodes, 1, "[B]");
  check_same_device(op, "num_nodes", num_nodes, "tree_tokens", tree_tokens);
  check_size(op, "num_nodes", num_nodes, 0, in.B, "B = tree_tokens.size(0)");
  in.tokens = tree_tokens.contiguous();
  in.first_child = first_child.contiguous();
  in.next_sibling = next_sibling.contiguous();
  in.num_nodes = num_nodes.contiguous();
  return in;
}

// A [B, T] (dims = 2) or [B] (dims = 1) float32 / int64 tensor on tree_tokens' device.
void check_like(const char* op, const char* name, const Tensor& t, c10::ScalarType dtype, const TreeInputs& in,
                int64_t dims, const Tensor& tree_tokens) {
  check_dtype(op, name, t, dtype);
  check_dim(op, name, t, dims, dims == 2 ? "[B, T]" : "[B]");
  check_same_device(op, name, t, "tree_tokens", tree_tokens);
  check_size(op, name, t, 0, in.B, "B = tree_tokens.size(0)");
  if (dims == 2) check_size(op, name, t, 1, in.T, "T = tree_tokens.size(1)");
}

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
  const TreeInputs in = check_tree_inputs(op, tree_tokens, first_child, next_sibling, num_nodes);
  check_like(op, "target_ids", target_ids_in, at::kLong, in, 2, tree_tokens);
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
  const TreeInputs in = check_tree_inputs(op, tree_tokens, first_child, next_sibling, num_nodes);
  check_dtype(op, "target_probs", target_probs_in, at::kFloat);
  check_dim(op, "target_probs", target_probs_in, 3, "[B, T, V]");
  check_same_device(op, "target_probs", target_probs_in, "tree_tokens", tree_tokens);
  check_size(op, "target_probs", target_probs_in, 0, in.B, "B = tree_tokens.size(0)");
  check_size(op, "target_probs", target_probs_in, 1, in.T, "T = tree_tokens.size(1)");
  const int64_t V = target_probs_in.size(2);
  HS_CHECK(V >= 1, op, ": expected target_probs.size(2) (the vocabulary) >= 1, got ", V);
  check_like(op, "coins", coins_in, at::kFloat, in, 2, tree_tokens);
  check_like(op, "final_coins", final_coins_in, at::kFloat, in, 1, tree_tokens);
  HS_CHECK(in.B <= 0x7fffffffLL, op, ": the CUDA kernel supports B < 2^31, got ", in.B);
  // The distinct child tokens of a node live in (dynamic) shared memory: T * 8 bytes.
  HS_CHECK(in.T <= 4096, op, ": the CUDA kernel supports T <= 4096 tree positions, got T = ", in.T);

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
  check_dim(op, "k_cache", k_cache, 5, "[num_layers, B, S, H_kv, D]");
  check_dim(op, "v_cache", v_cache, 5, "[num_layers, B, S, H_kv, D]");
  check_cuda(op, "k_cache", k_cache);
  check_same_device(op, "v_cache", v_cache, "k_cache", k_cache);
  HS_CHECK(k_cache.sizes() == v_cache.sizes(), op, ": expected v_cache of the same shape as k_cache ",
           sizes_str(k_cache), ", got ", sizes_str(v_cache));
  HS_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), op, ": expected v_cache of the same dtype as k_cache (",
           dtype_name(k_cache.scalar_type()), "), got ", dtype_name(v_cache.scalar_type()));
  HS_CHECK(k_cache.numel() == 0 || k_cache.const_data_ptr() != v_cache.const_data_ptr(), op,
           ": k_cache and v_cache must be different tensors");
  check_contiguous(op, "k_cache", k_cache);
  check_contiguous(op, "v_cache", v_cache);
  const int64_t NL = k_cache.size(0), B = k_cache.size(1), S = k_cache.size(2);
  check_dtype(op, "accept_path", accept_path_in, at::kLong);
  check_dim(op, "accept_path", accept_path_in, 2, "[B, P]");
  check_same_device(op, "accept_path", accept_path_in, "k_cache", k_cache);
  check_size(op, "accept_path", accept_path_in, 0, B, "B = k_cache.size(1)");
  const int64_t P = accept_path_in.size(1);
  HS_CHECK(P >= 1 || B == 0, op, ": expected accept_path.size(1) >= 1, got ", P);
  const std::pair<const char*, const Tensor*> vecs[] = {{"accept_len", &accept_len_in}, {"prefix_lens", &prefix_lens_in}};
  for (const auto& [name, t] : vecs) {
    check_dtype(op, name, *t, at::kLong);
    check_dim(op, name, *t, 1, "[B]");
    check_same_device(op, name, *t, "k_cache", k_cache);
    check_size(op, name, *t, 0, B, "B = k_cache.size(1)");
  }
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
