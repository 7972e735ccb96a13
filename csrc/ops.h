// Host entry points of every heterospec op, one per dispatch key.
// Shapes, dtypes and semantics: docs/design.md (the single source of truth) and README.md.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>

namespace heterospec {

using at::Tensor;

// ---- CPU ----
std::tuple<Tensor, Tensor, Tensor> topk_entropy_cpu(const Tensor& logits, int64_t k,
                                                    const std::optional<Tensor>& parent_entropy);
std::tuple<Tensor, Tensor, Tensor> select_tree_nodes_cpu(const Tensor& scores, const Tensor& parents,
                                                         const Tensor& budgets, int64_t max_nodes);
std::tuple<Tensor, Tensor, Tensor> entropy_bin_policy_cpu(const Tensor& path_entropy,
                                                          const Tensor& bin_edges,
                                                          const Tensor& bin_extra_depth,
                                                          const Tensor& bin_budget);
std::tuple<Tensor, Tensor, Tensor, Tensor> build_tree_cpu(const Tensor& tree_parents,
                                                          const Tensor& num_nodes,
                                                          const Tensor& prefix_lens);
std::tuple<Tensor, Tensor> tree_attention_mask_cpu(const Tensor& tree_mask, const Tensor& num_nodes,
                                                   const Tensor& prefix_lens, int64_t mask_numel);
Tensor dense_tree_attention_mask_cpu(const Tensor& tree_mask, const Tensor& prefix_lens, int64_t width);
std::tuple<Tensor, Tensor, Tensor> verify_greedy_cpu(const Tensor& tree_tokens, const Tensor& target_ids,
                                                     const Tensor& first_child, const Tensor& next_sibling,
                                                     const Tensor& num_nodes);
std::tuple<Tensor, Tensor, Tensor> verify_sampling_cpu(const Tensor& tree_tokens, const Tensor& target_probs,
                                                       const Tensor& first_child, const Tensor& next_sibling,
                                                       const Tensor& num_nodes, const Tensor& coins,
                                                       const Tensor& final_coins);
void compact_kv_cpu(Tensor& k_cache, Tensor& v_cache, const Tensor& accept_path, const Tensor& accept_len,
                    const Tensor& prefix_lens);
Tensor stream_linear_pack_cpu(const Tensor& weight);
Tensor stream_linear_cpu(const Tensor& x, const Tensor& packed_weight, const std::optional<Tensor>& bias,
                         int64_t out_features);
Tensor stream_linear_blocks_cpu(const Tensor& x, const Tensor& codes, const Tensor& scales,
                                const std::optional<Tensor>& bias, int64_t out_features);
Tensor rms_norm_cpu(const Tensor& x, const Tensor& weight, double eps);
std::tuple<Tensor, Tensor> rope_cpu(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin);
void rope_kv_write_cpu(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const Tensor& prefix_lens,
                       Tensor& q_out, Tensor& k_cache, Tensor& v_cache);
Tensor tree_attention_cpu(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& prefix_lens,
                          const Tensor& tree_mask, double scale);
void decoder_layer_cpu(const Tensor& x, const std::optional<Tensor>& norm1, double eps1, const Tensor& norm2,
                       double eps2, at::TensorList linears, at::IntArrayRef out_features, const Tensor& cos,
                       const Tensor& sin, const Tensor& prefix_lens, const Tensor& tree_mask, double scale,
                       Tensor& x_out, Tensor& k_cache, Tensor& v_cache, const std::optional<Tensor>& residual);
void decoder_layers_cpu(const Tensor& x, at::TensorList norms, at::ArrayRef<double> eps, at::TensorList linears,
                        at::IntArrayRef out_features, at::IntArrayRef layer_calls, const Tensor& cos,
                        const Tensor& sin, const Tensor& prefix_lens, const Tensor& tree_mask, double scale,
                        at::IntArrayRef taps, Tensor& x_out, Tensor& features, Tensor& k_cache, Tensor& v_cache);
std::tuple<Tensor, Tensor> corpus_lookup_cpu(const Tensor& corpus, const Tensor& suffix_order, const Tensor& context,
                                             int64_t k, int64_t min_match, int64_t max_match, int64_t sample,
                                             double agree);
Tensor greedy_tokens_cpu(const Tensor& logits);
std::tuple<Tensor, Tensor> sample_tokens_cpu(const Tensor& logits, const Tensor& uniforms, double temperature,
                                             int64_t top_k, double top_p);

// ---- CUDA (compiled only when torch has CUDA) ----
std::tuple<Tensor, Tensor, Tensor> topk_entropy_cuda(const Tensor& logits, int64_t k,
                                                     const std::optional<Tensor>& parent_entropy);
std::tuple<Tensor, Tensor, Tensor> select_tree_nodes_cuda(const Tensor& scores, const Tensor& parents,
                                                          const Tensor& budgets, int64_t max_nodes);
std::tuple<Tensor, Tensor, Tensor> entropy_bin_policy_cuda(const Tensor& path_entropy,
                                                           const Tensor& bin_edges,
                                                           const Tensor& bin_extra_depth,
                                                           const Tensor& bin_budget);
std::tuple<Tensor, Tensor, Tensor, Tensor> build_tree_cuda(const Tensor& tree_parents,
                                                           const Tensor& num_nodes,
                                                           const Tensor& prefix_lens);
std::tuple<Tensor, Tensor> tree_attention_mask_cuda(const Tensor& tree_mask, const Tensor& num_nodes,
                                                    const Tensor& prefix_lens, int64_t mask_numel);
Tensor dense_tree_attention_mask_cuda(const Tensor& tree_mask, const Tensor& prefix_lens, int64_t width);
std::tuple<Tensor, Tensor, Tensor> verify_greedy_cuda(const Tensor& tree_tokens, const Tensor& target_ids,
                                                      const Tensor& first_child, const Tensor& next_sibling,
                                                      const Tensor& num_nodes);
std::tuple<Tensor, Tensor, Tensor> verify_sampling_cuda(const Tensor& tree_tokens, const Tensor& target_probs,
                                                        const Tensor& first_child, const Tensor& next_sibling,
                                                        const Tensor& num_nodes, const Tensor& coins,
                                                        const Tensor& final_coins);
void compact_kv_cuda(Tensor& k_cache, Tensor& v_cache, const Tensor& accept_path, const Tensor& accept_len,
                     const Tensor& prefix_lens);

}  // namespace heterospec
