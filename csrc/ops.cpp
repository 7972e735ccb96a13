// The one place where heterospec's ops are declared (TORCH_LIBRARY). Kernels register per dispatch
// key next to their code: csrc/cpu/*.cpp (CPU) and csrc/cuda/*.cu (CUDA). Fake (meta) kernels live
// in heterospec/ops.py. Conventions: snake_case, int64 indices with -1 sentinel, written arguments
// annotated (a!), no stream arguments (kernels run on the current stream).
#include <torch/library.h>

// The CMake build (libheterospec_ops.so, loaded with torch.ops.load_library or from C++) defines
// HETEROSPEC_NO_PYTHON: no Python module stub and no libpython dependency.
#ifndef HETEROSPEC_NO_PYTHON
#include <Python.h>

extern "C" {
// Importing heterospec._C runs the static registrations below; no pybind11 module is needed.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
#endif  // HETEROSPEC_NO_PYTHON

TORCH_LIBRARY(heterospec, m) {
  // Meta-path entropy: top-k log-probs of each draft node plus the cumulative Top-K entropy.
  m.def("topk_entropy(Tensor logits, int k, Tensor? parent_entropy=None) -> "
        "(Tensor topk_logprobs, Tensor topk_ids, Tensor path_entropy)");
  // Entropy bin of each request and that bin's action (extra draft depth, Top-N budget).
  m.def("entropy_bin_policy(Tensor path_entropy, Tensor bin_edges, Tensor bin_extra_depth, "
        "Tensor bin_budget) -> (Tensor bins, Tensor extra_depth, Tensor budget)");
  // Top-N pruning: the budgets[b] best candidates, closed under ancestors, parents first.
  m.def("select_tree_nodes(Tensor scores, Tensor parents, Tensor budgets, int max_nodes) -> "
        "(Tensor tree_cand, Tensor tree_parents, Tensor num_nodes)");
  // Ancestor mask, positions and first-child / next-sibling links of the selected tree.
  m.def("build_tree(Tensor tree_parents, Tensor num_nodes, Tensor prefix_lens) -> "
        "(Tensor tree_mask, Tensor positions, Tensor first_child, Tensor next_sibling)");
  // FlashInfer custom_mask (flat, ragged over requests) for prefix + tree attention.
  m.def("tree_attention_mask(Tensor tree_mask, Tensor num_nodes, Tensor prefix_lens, int mask_numel) -> "
        "(Tensor custom_mask, Tensor mask_indptr)");
  // The same mask padded to a static cache width, for scaled_dot_product_attention.
  m.def("dense_tree_attention_mask(Tensor tree_mask, Tensor prefix_lens, int width) -> Tensor");
  // Greedy verification: longest path whose tokens match the target's argmax, plus the bonus.
  m.def("verify_greedy(Tensor tree_tokens, Tensor target_ids, Tensor first_child, Tensor next_sibling, "
        "Tensor num_nodes) -> (Tensor accept_path, Tensor accept_len, Tensor bonus)");
  // Lossless multi-candidate rejection sampling over siblings with caller-supplied uniforms.
  m.def("verify_sampling(Tensor tree_tokens, Tensor target_probs, Tensor first_child, Tensor next_sibling, "
        "Tensor num_nodes, Tensor coins, Tensor final_coins) -> "
        "(Tensor accept_path, Tensor accept_len, Tensor bonus)");
  // Move the accepted path's K/V rows to the end of each request's committed prefix, in place.
  m.def("compact_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor accept_path, Tensor accept_len, "
        "Tensor prefix_lens) -> ()");
  // CPU linear for the few rows of a tree verify: the weight packed once into blocks that one
  // call streams once for all rows (CPU kernels only).
  m.def("stream_linear_pack(Tensor weight) -> Tensor");
  m.def("stream_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
  // The same for a float32 weight stored as the exact codes of its block-quantised file (Q4_1, Q8_0).
  m.def("stream_linear_blocks(Tensor x, Tensor codes, Tensor scales, Tensor? bias, int out_features) -> Tensor");
  // A decoder layer's glue in one call each (CPU kernels only): RMSNorm of each row, and
  // rotate-half RoPE of Q and K with the cos / sin tables of their positions.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor q_out, Tensor k_out)");
  // The fused QKV projection's output to attention's inputs in one call: the rotated Q into q_out,
  // the rotated K and V into each request's cache slots prefix_lens[b] + t.
  m.def("rope_kv_write_(Tensor qkv, Tensor cos, Tensor sin, Tensor prefix_lens, Tensor(a!) q_out, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache) -> ()");
  // One Llama decoder layer of a decode step or a tree verify (a target's; or the EAGLE-3 draft's:
  // no norm1, its own residual), its kernels chained in C++ (CPU kernel only): the layer's
  // output into x_out, its new K / V rows into the layer's cache.
  m.def("decoder_layer_(Tensor x, Tensor? norm1, float eps1, Tensor norm2, float eps2, Tensor[] linears, "
        "int[] out_features, Tensor cos, Tensor sin, Tensor prefix_lens, Tensor tree_mask, float scale, "
        "Tensor(a!) x_out, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor? residual=None) -> ()");
  // A target's whole stack of L decoder layers in one call (CPU kernel only): decoder_layer_ for
  // layer 0 .. L - 1 in turn, each layer's tensors taken in order from the flat lists; the last
  // layer's output into x_out, the hidden states entering the layers in taps (L: the last output)
  // side by side into features, each layer's new K / V rows into its cache.
  m.def("decoder_layers_(Tensor x, Tensor[] norms, float[] eps, Tensor[] linears, int[] out_features, "
        "int[] layer_calls, Tensor cos, Tensor sin, Tensor prefix_lens, Tensor tree_mask, float scale, int[] taps, "
        "Tensor(a!) x_out, Tensor(b!) features, Tensor(c!) k_cache, Tensor(d!) v_cache) -> ()");
  // Attention of a few query rows (a decode step, a tree verify) to each request's cached prefix
  // and its own tree, the mask implicit (CPU kernel only).
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor prefix_lens, Tensor tree_mask, "
        "float scale) -> Tensor");
  // Datastore lookup (host op, CPU kernel only): the longest match of a context's last tokens in a
  // token corpus through its suffix order, and the continuation most of its occurrences agree on.
  m.def("corpus_lookup(Tensor corpus, Tensor suffix_order, Tensor context, int k, int min_match, int max_match, "
        "int sample, float agree) -> (Tensor chain, Tensor match)");
  // The greedy pick (CPU kernel only): per row of logits, the first index of the maximum (a NaN
  // counts as the maximum), as torch.argmax.
  m.def("greedy_tokens(Tensor logits) -> Tensor");
  // The keyed draw (CPU kernel only): per row of logits, the token that inverse CDF with the row's
  // uniform picks from softmax(logits / temperature) cut to top_k and the top_p nucleus, and
  // whether the row was a distribution.
  m.def("sample_tokens(Tensor logits, Tensor uniforms, float temperature, int top_k, float top_p) "
        "-> (Tensor tokens, Tensor ok)");
}
