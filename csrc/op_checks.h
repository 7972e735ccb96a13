// Metadata checks of every op (dtype, rank, device, sizes, scalar arguments), one function per op
// family, shared by the CPU host functions (csrc/cpu/*.cpp) and the CUDA launchers
// (csrc/cuda/*.cu), so both backends raise the same errors in the same order. They read no tensor
// data (no device sync). What stays out of here: the value checks that need the data (tree links,
// NaN rows, coins, accepted paths; CPU files only) and the CUDA kernels' own size limits (.cu).
// Same includes as checks.h, to keep the CUDA translation units lean.
#pragma once

#include "checks.h"

#include <cmath>

namespace heterospec {

// The backend a host function serves; it decides the device checks. On the CPU every tensor must
// be a CPU tensor (check_cpu); on CUDA the op's reference tensor must be a CUDA tensor
// (check_cuda) and every other tensor on the reference's device (check_same_device).
enum class Backend { CPU, CUDA };

// The reference tensor of an op.
inline void check_ref_device(Backend be, const char* op, const char* name, const at::Tensor& t) {
  if (be == Backend::CPU)
    check_cpu(op, name, t);
  else
    check_cuda(op, name, t);
}

// Any other tensor of the op; `ref` has passed check_ref_device.
inline void check_device(Backend be, const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                         const at::Tensor& ref) {
  if (be == Backend::CPU)
    check_cpu(op, name, t);
  else
    check_same_device(op, name, t, ref_name, ref);
}

// A [B] int64 request vector on the device of `ref`.
inline void check_request_vector(Backend be, const char* op, const char* name, const at::Tensor& t, int64_t B,
                                 const char* ref_name, const at::Tensor& ref) {
  check_dtype(op, name, t, at::kLong);
  check_dim(op, name, t, 1, "[B]");
  check_device(be, op, name, t, ref_name, ref);
  check_size(op, name, t, 0, B, "B, the batch size");
}

// ---- greedy_tokens / sample_tokens (CPU) ----------------------------------------------------------
// logits [..., V] float32 or bfloat16 on the CPU, V >= 1; returns V.
inline int64_t check_cpu_logit_rows(const char* op, const at::Tensor& logits) {
  check_cpu(op, "logits", logits);
  HS_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16, op,
           ": expected logits to be float32 or bfloat16, got ", dtype_name(logits.scalar_type()));
  HS_CHECK(logits.dim() >= 1, op, ": expected logits of shape [..., V], got a 0-dimensional tensor");
  const int64_t V = logits.size(-1);
  HS_CHECK(V >= 1, op, ": expected at least one logit per row (V >= 1), got V = ", V);
  return V;
}

// ---- topk_entropy --------------------------------------------------------------------------------
// logits [M, V] float32 / float16 / bfloat16; 1 <= k <= min(V, max_k) (max_k: the kernel's limit).
inline void check_topk_logits(Backend be, const char* op, const at::Tensor& logits, int64_t k, int64_t max_k) {
  check_float_dtype(op, "logits", logits);
  check_dim(op, "logits", logits, 2, "[M, V]");
  check_ref_device(be, op, "logits", logits);
  const int64_t V = logits.size(1), k_max = V < max_k ? V : max_k;
  HS_CHECK(k >= 1 && k <= k_max, op, ": expected 1 <= k <= min(V, ", max_k, ") = ", k_max, " (V = logits.size(1) = ", V,
           "), got k = ", k);
}

// parent_entropy [M] float32 on logits' device (check_same_device on both backends).
inline void check_parent_entropy(const char* op, const at::Tensor& parent_entropy, const at::Tensor& logits) {
  check_dtype(op, "parent_entropy", parent_entropy, at::kFloat);
  check_dim(op, "parent_entropy", parent_entropy, 1, "[M]");
  check_same_device(op, "parent_entropy", parent_entropy, "logits", logits);
  check_size(op, "parent_entropy", parent_entropy, 0, logits.size(0), "M = logits.size(0)");
}

// ---- entropy_bin_policy --------------------------------------------------------------------------
// path_entropy [B] float32, bin_edges [num_bins - 1] float32, bin_extra_depth / bin_budget
// [num_bins] int64.
inline void check_bin_policy_inputs(Backend be, const char* op, const at::Tensor& path_entropy,
                                    const at::Tensor& bin_edges, const at::Tensor& bin_extra_depth,
                                    const at::Tensor& bin_budget) {
  check_dtype(op, "path_entropy", path_entropy, at::kFloat);
  check_dtype(op, "bin_edges", bin_edges, at::kFloat);
  check_dtype(op, "bin_extra_depth", bin_extra_depth, at::kLong);
  check_dtype(op, "bin_budget", bin_budget, at::kLong);
  check_dim(op, "path_entropy", path_entropy, 1, "[B]");
  check_dim(op, "bin_edges", bin_edges, 1, "[num_bins - 1]");
  check_dim(op, "bin_extra_depth", bin_extra_depth, 1, "[num_bins]");
  check_dim(op, "bin_budget", bin_budget, 1, "[num_bins]");
  check_ref_device(be, op, "path_entropy", path_entropy);
  check_device(be, op, "bin_edges", bin_edges, "path_entropy", path_entropy);
  check_device(be, op, "bin_extra_depth", bin_extra_depth, "path_entropy", path_entropy);
  check_device(be, op, "bin_budget", bin_budget, "path_entropy", path_entropy);
  const int64_t nb = bin_edges.size(0) + 1;
  check_size(op, "bin_extra_depth", bin_extra_depth, 0, nb, "num_bins = bin_edges.size(0) + 1");
  check_size(op, "bin_budget", bin_budget, 0, nb, "num_bins = bin_edges.size(0) + 1");
}

// ---- select_tree_nodes ---------------------------------------------------------------------------
constexpr int64_t kMaxTreeNodes = int64_t{1} << 20;

// scores [B, C] float32, parents [B, C] int64, budgets [B] int64; 0 <= max_nodes <= kMaxTreeNodes.
inline void check_select_inputs(Backend be, const char* op, const at::Tensor& scores, const at::Tensor& parents,
                                const at::Tensor& budgets, int64_t max_nodes) {
  check_dtype(op, "scores", scores, at::kFloat);
  check_dim(op, "scores", scores, 2, "[B, C]");
  check_ref_device(be, op, "scores", scores);
  check_dtype(op, "parents", parents, at::kLong);
  check_dim(op, "parents", parents, 2, "[B, C]");
  check_device(be, op, "parents", parents, "scores", scores);
  const int64_t B = scores.size(0), C = scores.size(1);
  check_size(op, "parents", parents, 0, B, "B = scores.size(0)");
  check_size(op, "parents", parents, 1, C, "C = scores.size(1)");
  check_request_vector(be, op, "budgets", budgets, B, "scores", scores);
  // A verification tree is a few hundred nodes at most; a huge capacity is a caller bug that
  // would otherwise surface as an allocator failure.
  HS_CHECK(max_nodes >= 0 && max_nodes <= kMaxTreeNodes, op, ": expected max_nodes >= 0 and <= ", kMaxTreeNodes,
           ", got ", max_nodes);
}

// ---- build_tree, tree_attention_mask, dense_tree_attention_mask ---------------------------------
// tree_parents [B, T] int64, num_nodes [B] int64, prefix_lens [B] int64.
inline void check_build_tree_inputs(Backend be, const char* op, const at::Tensor& tree_parents,
                                    const at::Tensor& num_nodes, const at::Tensor& prefix_lens) {
  check_dtype(op, "tree_parents", tree_parents, at::kLong);
  check_dim(op, "tree_parents", tree_parents, 2, "[B, T]");
  check_ref_device(be, op, "tree_parents", tree_parents);
  const int64_t B = tree_parents.size(0);
  check_request_vector(be, op, "num_nodes", num_nodes, B, "tree_parents", tree_parents);
  check_request_vector(be, op, "prefix_lens", prefix_lens, B, "tree_parents", tree_parents);
}

// tree_mask [B, T, T] bool.
inline void check_tree_mask(Backend be, const char* op, const at::Tensor& tree_mask) {
  check_dtype(op, "tree_mask", tree_mask, at::kBool);
  check_dim(op, "tree_mask", tree_mask, 3, "[B, T, T]");
  check_ref_device(be, op, "tree_mask", tree_mask);
  check_size(op, "tree_mask", tree_mask, 2, tree_mask.size(1), "T = tree_mask.size(1); the mask is square");
}

// tree_mask [B, T, T] bool, num_nodes [B] int64, prefix_lens [B] int64.
inline void check_tree_attention_mask_inputs(Backend be, const char* op, const at::Tensor& tree_mask,
                                             const at::Tensor& num_nodes, const at::Tensor& prefix_lens) {
  check_tree_mask(be, op, tree_mask);
  const int64_t B = tree_mask.size(0);
  check_request_vector(be, op, "num_nodes", num_nodes, B, "tree_mask", tree_mask);
  check_request_vector(be, op, "prefix_lens", prefix_lens, B, "tree_mask", tree_mask);
}

// tree_mask [B, T, T] bool, prefix_lens [B] int64; width >= 0.
inline void check_dense_mask_inputs(Backend be, const char* op, const at::Tensor& tree_mask,
                                    const at::Tensor& prefix_lens, int64_t width) {
  check_tree_mask(be, op, tree_mask);
  check_request_vector(be, op, "prefix_lens", prefix_lens, tree_mask.size(0), "tree_mask", tree_mask);
  HS_CHECK(width >= 0, op, ": expected width >= 0, got ", width);
}

// ---- verify_greedy, verify_sampling --------------------------------------------------------------
// The tree of both verifiers: B, T and contiguous copies of its tensors.
struct TreeInputs {
  int64_t B = 0, T = 0;
  at::Tensor tokens, first_child, next_sibling, num_nodes;  // contiguous
};

// A [B, T] (dims = 2) or [B] (dims = 1) tensor of `dtype` on tree_tokens' device.
inline void check_tree_like(Backend be, const char* op, const char* name, const at::Tensor& t,
                            c10::ScalarType dtype, int64_t dims, int64_t B, int64_t T,
                            const at::Tensor& tree_tokens) {
  check_dtype(op, name, t, dtype);
  check_dim(op, name, t, dims, dims == 2 ? "[B, T]" : "[B]");
  check_device(be, op, name, t, "tree_tokens", tree_tokens);
  check_size(op, name, t, 0, B, "B = tree_tokens.size(0)");
  if (dims == 2) check_size(op, name, t, 1, T, "T = tree_tokens.size(1)");
}

// tree_tokens, first_child, next_sibling [B, T] int64 and num_nodes [B] int64, on tree_tokens'
// device. Metadata only: the CPU verifiers also check the links' values.
inline TreeInputs check_tree_inputs(Backend be, const char* op, const at::Tensor& tree_tokens,
                                    const at::Tensor& first_child, const at::Tensor& next_sibling,
                                    const at::Tensor& num_nodes) {
  check_dtype(op, "tree_tokens", tree_tokens, at::kLong);
  check_dim(op, "tree_tokens", tree_tokens, 2, "[B, T]");
  check_ref_device(be, op, "tree_tokens", tree_tokens);
  TreeInputs in;
  in.B = tree_tokens.size(0);
  in.T = tree_tokens.size(1);
  check_tree_like(be, op, "first_child", first_child, at::kLong, 2, in.B, in.T, tree_tokens);
  check_tree_like(be, op, "next_sibling", next_sibling, at::kLong, 2, in.B, in.T, tree_tokens);
  check_tree_like(be, op, "num_nodes", num_nodes, at::kLong, 1, in.B, in.T, tree_tokens);
  in.tokens = tree_tokens.contiguous();
  in.first_child = first_child.contiguous();
  in.next_sibling = next_sibling.contiguous();
  in.num_nodes = num_nodes.contiguous();
  return in;
}

// target_probs [B, T, V] float32 (V >= 1), coins [B, T] float32, final_coins [B] float32.
// Returns V.
inline int64_t check_verify_sampling_inputs(Backend be, const char* op, const TreeInputs& in,
                                            const at::Tensor& tree_tokens, const at::Tensor& target_probs,
                                            const at::Tensor& coins, const at::Tensor& final_coins) {
  check_dtype(op, "target_probs", target_probs, at::kFloat);
  check_dim(op, "target_probs", target_probs, 3, "[B, T, V]");
  check_device(be, op, "target_probs", target_probs, "tree_tokens", tree_tokens);
  check_size(op, "target_probs", target_probs, 0, in.B, "B = tree_tokens.size(0)");
  check_size(op, "target_probs", target_probs, 1, in.T, "T = tree_tokens.size(1)");
  const int64_t V = target_probs.size(2);
  HS_CHECK(V >= 1, op, ": expected target_probs.size(2) (the vocabulary) >= 1, got ", V);
  check_tree_like(be, op, "coins", coins, at::kFloat, 2, in.B, in.T, tree_tokens);
  check_tree_like(be, op, "final_coins", final_coins, at::kFloat, 1, in.B, in.T, tree_tokens);
  return V;
}

// ---- compact_kv_ ---------------------------------------------------------------------------------
struct KvDims {
  int64_t num_layers = 0, B = 0, S = 0, P = 0;
};

// k_cache, v_cache [num_layers, B, S, H_kv, D] (same shape and dtype, contiguous, not overlapping);
// accept_path [B, P] int64 (P >= 1 unless B == 0), accept_len [B] int64, prefix_lens [B] int64.
inline KvDims check_compact_kv_inputs(Backend be, const char* op, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& accept_path,
                                      const at::Tensor& accept_len, const at::Tensor& prefix_lens) {
  check_dim(op, "k_cache", k_cache, 5, "[num_layers, B, S, H_kv, D]");
  check_dim(op, "v_cache", v_cache, 5, "[num_layers, B, S, H_kv, D]");
  check_ref_device(be, op, "k_cache", k_cache);
  check_device(be, op, "v_cache", v_cache, "k_cache", k_cache);
  HS_CHECK(k_cache.sizes() == v_cache.sizes(), op, ": expected v_cache of the same shape as k_cache ",
           sizes_str(k_cache), ", got ", sizes_str(v_cache));
  HS_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), op, ": expected v_cache of the same dtype as k_cache (",
           dtype_name(k_cache.scalar_type()), "), got ", dtype_name(v_cache.scalar_type()));
  check_contiguous(op, "k_cache", k_cache);
  check_contiguous(op, "v_cache", v_cache);
  if (k_cache.numel() > 0) {
    // Both are contiguous, so each is exactly the byte range [ptr, ptr + nbytes): rows moved in
    // one cache must never land in the other (offset views of one buffer included).
    const char* k0 = static_cast<const char*>(k_cache.const_data_ptr());
    const char* v0 = static_cast<const char*>(v_cache.const_data_ptr());
    const auto nbytes = static_cast<std::ptrdiff_t>(k_cache.nbytes());
    HS_CHECK(k0 + nbytes <= v0 || v0 + nbytes <= k0, op,
             ": k_cache and v_cache must be different tensors whose memory does not overlap");
  }
  KvDims d;
  d.num_layers = k_cache.size(0);
  d.B = k_cache.size(1);
  d.S = k_cache.size(2);
  check_dtype(op, "accept_path", accept_path, at::kLong);
  check_dim(op, "accept_path", accept_path, 2, "[B, P]");
  check_device(be, op, "accept_path", accept_path, "k_cache", k_cache);
  check_size(op, "accept_path", accept_path, 0, d.B, "B = k_cache.size(1)");
  d.P = accept_path.size(1);
  HS_CHECK(d.P >= 1 || d.B == 0, op, ": expected accept_path.size(1) >= 1, got ", d.P);
  auto check_vector = [&](const char* name, const at::Tensor& t) {  // [B] int64
    check_dtype(op, name, t, at::kLong);
    check_dim(op, name, t, 1, "[B]");
    check_device(be, op, name, t, "k_cache", k_cache);
    check_size(op, name, t, 0, d.B, "B = k_cache.size(1)");
  };
  check_vector("accept_len", accept_len);
  check_vector("prefix_lens", prefix_lens);
  return d;
}

// ---- stream_linear_pack, stream_linear (CPU only) -------------------------------------------------
// float32 or bfloat16 (the types x and the result take).
inline void check_stream_dtype(const char* op, const char* name, const at::Tensor& t) {
  check_defined(op, name, t);
  const auto s = t.scalar_type();
  HS_CHECK(s == at::kFloat || s == at::kBFloat16, op, ": expected ", name,
           " of dtype torch.float32 or torch.bfloat16, got ", dtype_name(s));
}

// weight [N, K] float32, bfloat16 or float16 (the weight types the kernel streams) on the CPU.
inline void check_stream_linear_weight(const char* op, const at::Tensor& weight) {
  check_defined(op, "weight", weight);
  const auto s = weight.scalar_type();
  HS_CHECK(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf, op,
           ": expected weight of dtype torch.float32, torch.bfloat16 or torch.float16, got ", dtype_name(s));
  check_dim(op, "weight", weight, 2, "[N, K] (out_features x in_features)");
  check_cpu(op, "weight", weight);
}

// x [..., K] float32 or bfloat16, packed_weight [P, K, block] from stream_linear_pack of x's dtype
// (or float16 with a float32 x), bias [N] of x's dtype or none, block * (P - 1) < out_features = N
// <= block * P; all on the CPU.
inline void check_stream_linear_inputs(const char* op, const at::Tensor& x, const at::Tensor& packed_weight,
                                       const std::optional<at::Tensor>& bias, int64_t out_features,
                                       int64_t block) {
  check_stream_dtype(op, "x", x);
  HS_CHECK(x.dim() >= 1, op, ": expected x to have at least 1 dimension [..., K], got a 0-dimensional tensor");
  check_cpu(op, "x", x);
  if (!(x.scalar_type() == at::kFloat && packed_weight.defined() && packed_weight.scalar_type() == at::kHalf))
    check_dtype(op, "packed_weight", packed_weight, x.scalar_type());   // float16 weights: float32 x only
  check_dim(op, "packed_weight", packed_weight, 3, "[P, K, block] from stream_linear_pack");
  check_cpu(op, "packed_weight", packed_weight);
  check_size(op, "packed_weight", packed_weight, 2, block, "the block width of stream_linear_pack");
  check_size(op, "x", x, x.dim() - 1, packed_weight.size(1), "K = packed_weight.size(1), the in_features");
  const int64_t P = packed_weight.size(0);
  HS_CHECK(out_features > block * (P - 1) && out_features <= block * P, op, ": expected ", block * (P - 1),
           " < out_features <= ", block * P, " (packed_weight holds ", P, " blocks of ", block,
           " outputs), got out_features = ", out_features);
  if (bias.has_value() && bias->defined()) {
    check_dtype(op, "bias", *bias, x.scalar_type());
    check_dim(op, "bias", *bias, 1, "[N]");
    check_cpu(op, "bias", *bias);
    check_size(op, "bias", *bias, 0, out_features, "N = out_features");
  }
}

// x [..., K] float32 or bfloat16, codes [P, K, 16] uint8 (Q4_1) or [P, K, 32] int8 (Q8_0), scales
// [P, K / group, 2, block] float32, K a multiple of group, bias [N] of x's dtype or none,
// block * (P - 1) < out_features = N <= block * P; all on the CPU.
inline void check_stream_linear_blocks_inputs(const char* op, const at::Tensor& x, const at::Tensor& codes,
                                              const at::Tensor& scales, const std::optional<at::Tensor>& bias,
                                              int64_t out_features, int64_t block, int64_t group) {
  check_defined(op, "x", x);
  HS_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
           ": expected x of dtype torch.float32 or torch.bfloat16, got ", dtype_name(x.scalar_type()));
  HS_CHECK(x.dim() >= 1, op, ": expected x to have at least 1 dimension [..., K], got a 0-dimensional tensor");
  check_cpu(op, "x", x);
  check_defined(op, "codes", codes);
  const auto ct = codes.scalar_type();
  HS_CHECK(ct == at::kByte || ct == at::kChar, op, ": expected codes of dtype torch.uint8 (Q4_1) or torch.int8 (Q8_0), got ",
           dtype_name(ct));
  const int64_t per_k = ct == at::kByte ? block / 2 : block;
  check_dim(op, "codes", codes, 3, ct == at::kByte ? "[P, K, 16] (Q4_1)" : "[P, K, 32] (Q8_0)");
  check_cpu(op, "codes", codes);
  check_size(op, "codes", codes, 2, per_k, ct == at::kByte ? "16 bytes of Q4_1 codes per input" : "32 Q8_0 codes per input");
  check_size(op, "x", x, x.dim() - 1, codes.size(1), "K = codes.size(1), the in_features");
  const int64_t P = codes.size(0), K = codes.size(1);
  HS_CHECK(K % group == 0, op, ": expected in_features K to be a multiple of ", group, " (one scale group), got ", K);
  check_dtype(op, "scales", scales, at::kFloat);
  check_dim(op, "scales", scales, 4, "[P, K / 32, 2, 32]");
  check_cpu(op, "scales", scales);
  check_size(op, "scales", scales, 0, P, "P = codes.size(0), the blocks");
  check_size(op, "scales", scales, 1, K / group, "K / 32, the scale groups");
  check_size(op, "scales", scales, 2, 2, "2 (d, then m)");
  check_size(op, "scales", scales, 3, block, "the block width 32");
  HS_CHECK(out_features > block * (P - 1) && out_features <= block * P, op, ": expected ", block * (P - 1),
           " < out_features <= ", block * P, " (codes hold ", P, " blocks of ", block,
           " outputs), got out_features = ", out_features);
  if (bias.has_value() && bias->defined()) {
    check_dtype(op, "bias", *bias, x.scalar_type());
    check_dim(op, "bias", *bias, 1, "[N]");
    check_cpu(op, "bias", *bias);
    check_size(op, "bias", *bias, 0, out_features, "N = out_features");
  }
}

// A layer's KV cache pair: k_cache, v_cache [B, S, Hkv, D] of `dtype`, on ref's device, one B and D.
inline void check_cache_pair(Backend be, const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             at::ScalarType dtype, const char* ref_name, const at::Tensor& ref, int64_t B,
                             const char* b_what, int64_t D, const char* d_what) {
  const char* names[2] = {"k_cache", "v_cache"};
  const at::Tensor* caches[2] = {&k_cache, &v_cache};
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& c = *caches[i];
    check_dtype(op, names[i], c, dtype);
    check_dim(op, names[i], c, 4, "[B, S, Hkv, D]");
    check_device(be, op, names[i], c, ref_name, ref);
    check_size(op, names[i], c, 0, B, b_what);
    check_size(op, names[i], c, 3, D, d_what);
  }
  check_size(op, "v_cache", v_cache, 1, k_cache.size(1), "S = k_cache.size(1)");
  check_size(op, "v_cache", v_cache, 2, k_cache.size(2), "Hkv = k_cache.size(2)");
}

// RoPE tables: cos, sin [B, T, D] of `dtype`, on ref's device.
inline void check_rope_tables(Backend be, const char* op, const at::Tensor& cos, const at::Tensor& sin,
                              at::ScalarType dtype, const char* ref_name, const at::Tensor& ref, int64_t B,
                              const char* b_what, int64_t T, const char* t_what, int64_t D, const char* d_what) {
  const char* names[2] = {"cos", "sin"};
  const at::Tensor* tables[2] = {&cos, &sin};
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& t = *tables[i];
    check_dtype(op, names[i], t, dtype);
    check_dim(op, names[i], t, 3, "[B, T, D]");
    check_device(be, op, names[i], t, ref_name, ref);
    check_size(op, names[i], t, 0, B, b_what);
    check_size(op, names[i], t, 1, T, t_what);
    check_size(op, names[i], t, 2, D, d_what);
  }
}

// ---- rms_norm, rope (CPU only) ----------------------------------------------------------------------
// x [..., H] float32 / float16 / bfloat16 (at least 1 dimension), weight [H] of x's dtype, eps >= 0
// and finite; on the CPU.
inline void check_rms_norm_inputs(Backend be, const char* op, const at::Tensor& x, const at::Tensor& weight,
                                  double eps) {
  check_float_dtype(op, "x", x);
  HS_CHECK(x.dim() >= 1, op, ": expected x to have at least 1 dimension [..., H], got a 0-dimensional tensor");
  check_ref_device(be, op, "x", x);
  check_dtype(op, "weight", weight, x.scalar_type());
  check_dim(op, "weight", weight, 1, "[H]");
  check_device(be, op, "weight", weight, "x", x);
  check_size(op, "weight", weight, 0, x.size(-1), "H = x.size(-1)");
  HS_CHECK(std::isfinite(eps) && eps >= 0, op, ": expected a finite eps >= 0, got ", eps);
}

// q [B, T, Hq, D], k [B, T, Hk, D], cos, sin [B, T, D]: one float dtype, D even; on the CPU.
inline void check_rope_inputs(Backend be, const char* op, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& cos, const at::Tensor& sin) {
  check_float_dtype(op, "q", q);
  check_dim(op, "q", q, 4, "[B, T, Hq, D]");
  check_ref_device(be, op, "q", q);
  HS_CHECK(q.size(3) % 2 == 0, op, ": expected an even head size D = q.size(3) (rotate-half RoPE), got ",
           q.size(3));
  check_dtype(op, "k", k, q.scalar_type());
  check_dim(op, "k", k, 4, "[B, T, Hk, D]");
  check_device(be, op, "k", k, "q", q);
  check_size(op, "k", k, 0, q.size(0), "B = q.size(0)");
  check_size(op, "k", k, 1, q.size(1), "T = q.size(1)");
  check_size(op, "k", k, 3, q.size(3), "D = q.size(3)");
  check_rope_tables(be, op, cos, sin, q.scalar_type(), "q", q, q.size(0), "B = q.size(0)", q.size(1), "T = q.size(1)",
                    q.size(3), "D = q.size(3)");
}

// ---- rope_kv_write_ (CPU only) ---------------------------------------------------------------------
// qkv [B, T, (Hq + 2 Hkv) * D] float32 / float16 / bfloat16 (last stride 1); cos, sin [B, T, D];
// prefix_lens [B] int64; q_out [B, T, Hq, D] contiguous; k_cache, v_cache [B, S, Hkv, D] with rows
// of D contiguous; all of qkv's dtype, D even, on the CPU. (The slots are checked by the kernel.)
inline void check_rope_kv_write_inputs(Backend be, const char* op, const at::Tensor& qkv, const at::Tensor& cos,
                                       const at::Tensor& sin, const at::Tensor& prefix_lens, const at::Tensor& q_out,
                                       const at::Tensor& k_cache, const at::Tensor& v_cache) {
  check_float_dtype(op, "qkv", qkv);
  check_dim(op, "qkv", qkv, 3, "[B, T, (Hq + 2 Hkv) * D]");
  check_ref_device(be, op, "qkv", qkv);
  check_dtype(op, "q_out", q_out, qkv.scalar_type());
  check_dim(op, "q_out", q_out, 4, "[B, T, Hq, D]");
  check_device(be, op, "q_out", q_out, "qkv", qkv);
  check_size(op, "q_out", q_out, 0, qkv.size(0), "B = qkv.size(0)");
  check_size(op, "q_out", q_out, 1, qkv.size(1), "T = qkv.size(1)");
  HS_CHECK(q_out.is_contiguous(), op, ": expected q_out to be contiguous");
  check_cache_pair(be, op, k_cache, v_cache, qkv.scalar_type(), "qkv", qkv, qkv.size(0), "B = qkv.size(0)",
                   q_out.size(3), "D = q_out.size(3)");
  for (const at::Tensor* c : {&k_cache, &v_cache})
    HS_CHECK(c->size(3) <= 1 || c->stride(3) == 1, op, ": expected ", c == &k_cache ? "k_cache" : "v_cache",
             "'s rows of D values to be contiguous (stride(3) == 1), got stride ", c->stride(3));
  const int64_t Hq = q_out.size(2), Hkv = k_cache.size(2), D = q_out.size(3);
  HS_CHECK(D % 2 == 0, op, ": expected an even head size D = q_out.size(3) (rotate-half RoPE), got ", D);
  check_size(op, "qkv", qkv, 2, (Hq + 2 * Hkv) * D, "(Hq + 2 Hkv) * D = (q_out.size(2) + 2 k_cache.size(2)) * D");
  HS_CHECK(qkv.size(2) <= 1 || qkv.stride(2) == 1, op, ": expected qkv's last dimension to be contiguous, got stride ",
           qkv.stride(2));
  check_rope_tables(be, op, cos, sin, qkv.scalar_type(), "qkv", qkv, qkv.size(0), "B = qkv.size(0)", qkv.size(1),
                    "T = qkv.size(1)", D, "D = q_out.size(3)");
  check_request_vector(be, op, "prefix_lens", prefix_lens, qkv.size(0), "qkv", qkv);
}

// ---- decoder_layer_ (CPU only) ---------------------------------------------------------------------
// How a decoder layer's linears run: QKV as one fused call or three (Q, K, V), gate/up as one or
// two (gate, up), O and down as one each. The number of output widths (4 to 7) says which:
// 4 = both fused, 5 = gate/up split, 6 = QKV split, 7 = both split. Indices are of linear calls.
struct LayerCalls {
  int64_t qkv = 1, gate_up = 1;
  int64_t count() const { return qkv + gate_up + 2; }
  int64_t o() const { return qkv; }
  int64_t gate() const { return qkv + 1; }
  int64_t down() const { return qkv + 1 + gate_up; }
  // the query heads and the MLP width, from widths the check accepted
  int64_t hq(at::IntArrayRef of, int64_t Hkv, int64_t D) const { return qkv == 1 ? of[0] / D - 2 * Hkv : of[0] / D; }
  int64_t intermediate(at::IntArrayRef of) const { return gate_up == 1 ? of[gate()] / 2 : of[gate()]; }
};

// What the layer itself asks (each kernel it calls checks its own inputs): x [B, T, Hin] float32
// or bfloat16; residual r [B, T, H] of x's dtype (x itself where the op got none, Hin = H); one
// (weight, scales) pair and one output width per linear call (LayerCalls); QKV's widths
// (Hq + 2 Hkv) D fused or Hq D, Hkv D, Hkv D with Hq >= 1; O and down H; gate/up 2 I fused or I, I;
// x_out like r, contiguous; k_cache [B, S, Hkv, D]; tree_mask [B, T, C] bool with C >= T.
inline LayerCalls check_decoder_layer_inputs(Backend be, const char* op, const at::Tensor& x, const at::Tensor& r,
                                             at::TensorList linears, at::IntArrayRef out_features,
                                             const at::Tensor& k_cache, const at::Tensor& x_out,
                                             const at::Tensor& prefix_lens, const at::Tensor& tree_mask) {
  HS_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
           ": expected x of dtype float32 or bfloat16, got ", x.scalar_type());
  check_dim(op, "x", x, 3, "[B, T, Hin]");
  check_ref_device(be, op, "x", x);
  if (!r.is_same(x)) {
    check_dtype(op, "residual", r, x.scalar_type());
    check_device(be, op, "residual", r, "x", x);
    check_dim(op, "residual", r, 3, "[B, T, H]");
    check_size(op, "residual", r, 0, x.size(0), "B = x.size(0)");
    check_size(op, "residual", r, 1, x.size(1), "T = x.size(1)");
  }
  const int64_t n = static_cast<int64_t>(out_features.size());
  HS_CHECK(n >= 4 && n <= 7, op, ": expected 4 to 7 out_features (QKV as 1 or 3 calls, O, gate/up as 1 or 2 calls, ",
           "down), got ", n);
  const LayerCalls c{(n == 6 || n == 7) ? 3 : 1, (n == 5 || n == 7) ? 2 : 1};
  HS_CHECK(static_cast<int64_t>(linears.size()) == 2 * n, op, ": expected ", 2 * n,
           " linears tensors (weight, scales) for the ", n, " out_features, got ", linears.size());
  check_dim(op, "k_cache", k_cache, 4, "[B, S, Hkv, D]");
  const int64_t Hin = x.size(2), H = r.size(2), Hkv = k_cache.size(2), D = k_cache.size(3);
  if (c.qkv == 1) {
    HS_CHECK(D >= 1 && out_features[0] % D == 0 && out_features[0] / D - 2 * Hkv >= 1, op,
             ": expected out_features[0] = (Hq + 2 Hkv) * D with Hq >= 1 (Hkv = ", Hkv, ", D = ", D,
             " from k_cache), got ", out_features[0]);
  } else {
    HS_CHECK(D >= 1 && out_features[0] % D == 0 && out_features[0] >= D && out_features[1] == Hkv * D &&
                 out_features[2] == Hkv * D, op,
             ": expected out_features[0:3] (Q, K, V) = Hq * D, Hkv * D, Hkv * D with Hq >= 1 (Hkv = ", Hkv, ", D = ",
             D, " from k_cache), got ", out_features[0], ", ", out_features[1], ", ", out_features[2]);
  }
  HS_CHECK(out_features[c.o()] == H && out_features[c.down()] == H, op, ": expected out_features[", c.o(),
           "] (O) and out_features[", c.down(), "] (down) to be H = ", r.is_same(x) ? "x" : "residual",
           ".size(2) = ", H, ", got ", out_features[c.o()], " and ", out_features[c.down()]);
  if (c.gate_up == 1) {
    HS_CHECK(out_features[c.gate()] >= 2 && out_features[c.gate()] % 2 == 0, op, ": expected out_features[",
             c.gate(), "] (gate and up, fused) to be even, got ", out_features[c.gate()]);
  } else {
    HS_CHECK(out_features[c.gate()] >= 1 && out_features[c.gate()] == out_features[c.gate() + 1], op,
             ": expected out_features[", c.gate(), "] (gate) and out_features[", c.gate() + 1,
             "] (up) to be one width I >= 1, got ", out_features[c.gate()], " and ", out_features[c.gate() + 1]);
  }
  check_dtype(op, "x_out", x_out, x.scalar_type());
  check_device(be, op, "x_out", x_out, "x", x);
  HS_CHECK(x_out.sizes() == r.sizes() && x_out.is_contiguous(), op, ": expected x_out contiguous of ",
           r.is_same(x) ? "x" : "residual", "'s shape ", r.sizes(), ", got ", x_out.sizes());
  // What would fail only after the cache was written: the later linears' input widths, the mask,
  // the lengths and the slots (so a refused call writes nothing).
  const int64_t Hq = c.hq(out_features, Hkv, D), I = c.intermediate(out_features);
  for (int64_t i = 0; i < n; ++i) {
    const bool is_o = i == c.o(), is_down = i == c.down();
    const bool is_qkv = i < c.o(), is_gate_up = !is_qkv && !is_o && !is_down;
    const int64_t K = is_qkv ? Hin : is_o ? Hq * D : is_down ? I : H;
    const char* which = is_qkv ? "QKV" : is_o ? "O" : is_gate_up ? "gate/up" : "down";
    HS_CHECK(linears[2 * i].dim() == 3 && linears[2 * i].size(1) == K, op, ": expected the ", which,
             " weight linears[", 2 * i, "] packed as [P, ", K, ", 16 or 32], got ", linears[2 * i].sizes());
  }
  check_request_vector(be, op, "prefix_lens", prefix_lens, x.size(0), "x", x);
  check_dtype(op, "tree_mask", tree_mask, at::kBool);
  check_dim(op, "tree_mask", tree_mask, 3, "[B, T, C]");
  check_size(op, "tree_mask", tree_mask, 0, x.size(0), "B = x.size(0)");
  check_size(op, "tree_mask", tree_mask, 1, x.size(1), "T = x.size(1)");
  const int64_t C = tree_mask.size(2);
  HS_CHECK(C >= x.size(1), op, ": expected tree_mask's columns C = tree_mask.size(2) >= T = x.size(1), got C = ", C);
  if (be == Backend::CPU) {
    const at::Tensor lens = prefix_lens.contiguous();
    const int64_t* lp = lens.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < x.size(0); ++b)
      HS_CHECK(lp[b] >= 0 && lp[b] + C <= k_cache.size(1), op, ": expected 0 <= prefix_lens[", b,
               "] and prefix_lens[", b, "] + C <= S = k_cache.size(1) = ", k_cache.size(1), ", got ", lp[b],
               " (C = tree_mask.size(2) = ", C, ")");
  }
  return c;
}

// ---- decoder_layers_ (CPU only) --------------------------------------------------------------------
// The stack's own lists (each layer's tensors are then checked as decoder_layer_'s): x [B, T, H]
// contiguous; L = layer_calls.size() >= 1, each 4 to 7, summing to out_features.size(), with
// 2 out_features.size() linears; 2 L norms [H] of x's dtype and 2 L finite eps >= 0; taps in
// 0 .. L; x_out like x, contiguous, not x; features [B, T, len(taps) H] of x's dtype; k_cache,
// v_cache one shape [L, B, S, Hkv, D] of x's dtype. Returns L.
inline int64_t check_decoder_layers_inputs(Backend be, const char* op, const at::Tensor& x, at::TensorList norms,
                                           at::ArrayRef<double> eps, at::TensorList linears,
                                           at::IntArrayRef out_features, at::IntArrayRef layer_calls,
                                           at::IntArrayRef taps, const at::Tensor& x_out, const at::Tensor& features,
                                           const at::Tensor& k_cache, const at::Tensor& v_cache) {
  HS_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
           ": expected x of dtype float32 or bfloat16, got ", x.scalar_type());
  check_dim(op, "x", x, 3, "[B, T, H]");
  check_ref_device(be, op, "x", x);
  HS_CHECK(x.is_contiguous(), op, ": expected a contiguous x");
  const int64_t L = static_cast<int64_t>(layer_calls.size());
  HS_CHECK(L >= 1, op, ": expected at least one layer (layer_calls has one entry per layer), got none");
  int64_t calls = 0;
  for (int64_t i = 0; i < L; ++i) {
    HS_CHECK(layer_calls[i] >= 4 && layer_calls[i] <= 7, op, ": expected layer_calls[", i,
             "] to be 4 to 7 (a layer's linear calls, as decoder_layer_'s out_features), got ", layer_calls[i]);
    calls += layer_calls[i];
  }
  HS_CHECK(static_cast<int64_t>(out_features.size()) == calls, op, ": expected ", calls,
           " out_features (the sum of layer_calls), got ", out_features.size());
  HS_CHECK(static_cast<int64_t>(linears.size()) == 2 * calls, op, ": expected ", 2 * calls,
           " linears tensors (weight, scales) for the ", calls, " out_features, got ", linears.size());
  HS_CHECK(static_cast<int64_t>(norms.size()) == 2 * L && static_cast<int64_t>(eps.size()) == 2 * L, op,
           ": expected 2 L = ", 2 * L, " norms and eps (norm1 and norm2 of each of the L = layer_calls.size() ",
           "layers), got ", norms.size(), " norms and ", eps.size(), " eps");
  const int64_t H = x.size(2);
  for (int64_t i = 0; i < 2 * L; ++i) {
    const std::string name = "norms[" + std::to_string(i) + "]";
    check_dtype(op, name.c_str(), norms[i], x.scalar_type());
    check_device(be, op, name.c_str(), norms[i], "x", x);
    check_dim(op, name.c_str(), norms[i], 1, "[H]");
    check_size(op, name.c_str(), norms[i], 0, H, "H = x.size(2)");
    HS_CHECK(std::isfinite(eps[i]) && eps[i] >= 0, op, ": expected a finite eps[", i, "] >= 0, got ", eps[i]);
  }
  const auto check_cache = [&](const char* name, const at::Tensor& t) {
    check_dtype(op, name, t, x.scalar_type());
    check_device(be, op, name, t, "x", x);
    check_dim(op, name, t, 5, "[L, B, S, Hkv, D]");
    check_size(op, name, t, 0, L, "L = layer_calls.size()");
    check_size(op, name, t, 1, x.size(0), "B = x.size(0)");
  };
  check_cache("k_cache", k_cache);
  check_cache("v_cache", v_cache);
  HS_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": expected v_cache of k_cache's shape ", k_cache.sizes(), ", got ",
           v_cache.sizes());
  for (size_t j = 0; j < taps.size(); ++j)
    HS_CHECK(taps[j] >= 0 && taps[j] <= L, op, ": expected taps in 0 .. L = ", L, " (L: the last layer's output), got taps[",
             j, "] = ", taps[j]);
  check_dtype(op, "x_out", x_out, x.scalar_type());
  check_device(be, op, "x_out", x_out, "x", x);
  HS_CHECK(x_out.sizes() == x.sizes() && x_out.is_contiguous() && !x_out.is_same(x), op,
           ": expected x_out contiguous of x's shape ", x.sizes(), " and not x itself, got ", x_out.sizes());
  check_dtype(op, "features", features, x.scalar_type());
  check_device(be, op, "features", features, "x", x);
  const int64_t width = static_cast<int64_t>(taps.size()) * H;
  HS_CHECK(features.dim() == 3 && features.size(0) == x.size(0) && features.size(1) == x.size(1) &&
               features.size(2) == width, op, ": expected features [B, T, len(taps) * H] = [", x.size(0), ", ",
           x.size(1), ", ", width, "], got ", features.sizes());
  return L;
}

// ---- tree_attention (CPU only) ---------------------------------------------------------------------
// q [B, T, Hq, D] float32 / float16 / bfloat16; k_cache, v_cache [B, S, Hkv, D] of q's dtype with
// Hq a multiple of Hkv; prefix_lens [B] int64; tree_mask [B, T, C] bool; a finite scale; on the CPU.
inline void check_tree_attention_inputs(Backend be, const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                        const at::Tensor& v_cache, const at::Tensor& prefix_lens,
                                        const at::Tensor& tree_mask, double scale) {
  check_float_dtype(op, "q", q);
  check_dim(op, "q", q, 4, "[B, T, Hq, D]");
  check_ref_device(be, op, "q", q);
  check_cache_pair(be, op, k_cache, v_cache, q.scalar_type(), "q", q, q.size(0), "B = q.size(0)", q.size(3),
                   "D = q.size(3)");
  HS_CHECK(k_cache.size(2) >= 1 && q.size(2) % k_cache.size(2) == 0, op,
           ": expected the query heads Hq = q.size(2) to be a multiple of the KV heads Hkv = k_cache.size(2), got Hq = ",
           q.size(2), ", Hkv = ", k_cache.size(2));
  check_request_vector(be, op, "prefix_lens", prefix_lens, q.size(0), "q", q);
  check_dtype(op, "tree_mask", tree_mask, at::kBool);
  check_dim(op, "tree_mask", tree_mask, 3, "[B, T, C]");
  check_ref_device(be, op, "tree_mask", tree_mask);
  check_size(op, "tree_mask", tree_mask, 0, q.size(0), "B = q.size(0)");
  check_size(op, "tree_mask", tree_mask, 1, q.size(1), "T = q.size(1)");
  HS_CHECK(std::isfinite(scale), op, ": expected a finite scale, got ", scale);
}

}  // namespace heterospec
