// CPU kernel: decoder_layer_. Contract: docs/design.md, op 13.
//
// Why this exists. A Llama decoder layer of a decode step or a tree verify on the CPU is a chain
// of about a dozen kernels (two RMSNorms, four streamed linears, RoPE with the cache write, tree
// attention, SwiGLU, two residual adds) whose work at a few rows is tens of microseconds each.
// Called from Python, each costs an interpreter round trip and an ATen dispatch on top, about
// 1-2 ms over a 30-layer forward (bench/RESULTS.md, fifty-ninth session). Here the chain runs in
// C++: heterospec's kernels are called directly, ATen's (add, silu, mul) through the dispatcher
// from C++.
//
// Same kernels, same order, same arguments as the Python layers (models.target.StreamedLayer, the
// EAGLE-3 draft's models.draft.Eagle3Draft._streamed_layer), so the same bits: every row
// invariance those kernels promise holds for the layer.
//
// Layout. x [B, T, Hin] (float32, or bfloat16 with float / bfloat16 weights: what the linears
// take); linears: one (weight, scales) pair per linear call, in order QKV (one fused call of Hq,
// Hkv, Hkv heads of D, or three: Q, K, V), O, gate/up (one fused call of I, I, or two: gate, up),
// down. scales with no elements: weight is stream_linear's packed form; otherwise weight and
// scales are stream_linear_blocks' codes and scales. out_features: the calls' output widths; its
// length (4 to 7) says which groups are fused (LayerCalls). Fused or not, a linear's outputs are
// the same bits (each output column is its own dot product), so the layer takes whatever calls
// the tuned linears chose at this row count. cos, sin [B, T, D]; prefix_lens [B]; tree_mask
// [B, T, C] bool, C >= T (C - T tree columns of earlier steps before the T new rows, as
// tree_attention takes them); k_cache, v_cache [B, S, Hkv, D] (one layer's cache: the T new rows
// are written at slots prefix_lens[b] + C - T + t); residual [B, T, H] or none (then x, Hin = H);
// x_out [B, T, H] (written):
//   h  = norm1 ? rms_norm(x, norm1, eps1) : x;   q = rope_kv_write_(QKV(h), cos, sin) (K, V to the cache)
//   x1 = (residual or x) + O(tree_attention(q, k_cache, v_cache, prefix_lens, tree_mask, scale))
//   g, u = gate/up(rms_norm(x1, norm2, eps2));   x_out = x1 + down(silu(g) * u)
// A target layer passes norm1 and no residual (C = T); the EAGLE-3 draft's layer passes its
// already normalised [embedding, hidden] (Hin = 2 H), no norm1, and its hidden state as residual.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "op_checks.h"
#include "ops.h"

namespace heterospec {
namespace {

// linear call i: stream_linear (packed weight) or stream_linear_blocks (codes + scales).
Tensor run_linear(const Tensor& x, const at::TensorList& linears, const at::IntArrayRef& out_features, int64_t i) {
  const Tensor& w = linears[2 * i];
  const Tensor& s = linears[2 * i + 1];
  if (s.numel() == 0) return stream_linear_cpu(x, w, std::nullopt, out_features[i]);
  return stream_linear_blocks_cpu(x, w, s, std::nullopt, out_features[i]);
}

}  // namespace

void decoder_layer_cpu(const Tensor& x, const std::optional<Tensor>& norm1, double eps1, const Tensor& norm2,
                       double eps2, at::TensorList linears, at::IntArrayRef out_features, const Tensor& cos,
                       const Tensor& sin, const Tensor& prefix_lens, const Tensor& tree_mask, double scale,
                       Tensor& x_out, Tensor& k_cache, Tensor& v_cache, const std::optional<Tensor>& residual) {
  constexpr const char* op = "decoder_layer_";
  const bool has_norm1 = norm1.has_value() && norm1->defined();
  const Tensor& r = residual.has_value() && residual->defined() ? *residual : x;
  const LayerCalls c = check_decoder_layer_inputs(Backend::CPU, op, x, r, linears, out_features, k_cache, x_out,
                                                  prefix_lens, tree_mask);
  const int64_t B = x.size(0), T = x.size(1), C = tree_mask.size(2);
  const int64_t Hkv = k_cache.size(2), D = k_cache.size(3);
  const int64_t Hq = c.hq(out_features, Hkv, D), I = c.intermediate(out_features);
  // 1. attention half (the new rows' K, V at prefix_lens + C - T: after earlier tree columns)
  const Tensor h = has_norm1 ? rms_norm_cpu(x, *norm1, eps1) : x;
  const Tensor qkv = c.qkv == 1 ? run_linear(h, linears, out_features, 0)
                                : at::cat({run_linear(h, linears, out_features, 0),
                                           run_linear(h, linears, out_features, 1),
                                           run_linear(h, linears, out_features, 2)}, -1);
  Tensor q = at::empty({B, T, Hq, D}, qkv.options());
  rope_kv_write_cpu(qkv, cos, sin, C == T ? prefix_lens : at::add(prefix_lens, C - T), q, k_cache, v_cache);
  const Tensor o = tree_attention_cpu(q, k_cache, v_cache, prefix_lens, tree_mask, scale);
  const Tensor x1 = at::add(r, run_linear(o.view({B, T, Hq * D}), linears, out_features, c.o()));
  // 2. MLP half
  const Tensor h2 = rms_norm_cpu(x1, norm2, eps2);
  Tensor m;
  if (c.gate_up == 1) {
    const Tensor gu = run_linear(h2, linears, out_features, c.gate());
    m = at::mul(at::silu(gu.narrow(-1, 0, I)), gu.narrow(-1, I, I));
  } else {
    const Tensor g = run_linear(h2, linears, out_features, c.gate());
    m = at::mul(at::silu(g), run_linear(h2, linears, out_features, c.gate() + 1));
  }
  at::add_out(x_out, x1, run_linear(m, linears, out_features, c.down()));
}

// decoder_layers_: a target's L layers in one call. Why: a one-token forward of the built-in
// target spent a good part of its time between its 30 decoder_layer_ calls (the Python layer
// object, the op's argument conversion, a view of each layer's cache), with a core idle meanwhile
// (bench/RESULTS.md, sixty-first session). The loop below is that Python loop: the same
// decoder_layer_ per layer, so the same bits.
//
// Layout. x [B, T, H]; norms [2 L] (layer i: norm1 = norms[2 i], norm2 = norms[2 i + 1], each [H]),
// eps [2 L] likewise; layer_calls [L]: layer i's number of linear calls n_i (4 to 7, as
// decoder_layer_'s out_features); out_features: the n_i widths of layer 0, then of layer 1, ...;
// linears: the 2 n_i (weight, scales) tensors of layer 0, then of layer 1, ...; cos, sin,
// prefix_lens, tree_mask, scale: decoder_layer_'s, shared by every layer; taps: layer indices in
// 0 .. L, any order; k_cache, v_cache [L, B, S, Hkv, D] (layer i's cache: [i]). Written: x_out
// [B, T, H] contiguous (the last layer's output, before any final norm); features [B, T,
// len(taps) H]: the hidden states entering layer taps[j] (taps[j] = L: x_out) side by side.
// Every layer's inputs are checked (decoder_layer_'s checks, named by layer) before any runs, so
// a refused call writes nothing.
void decoder_layers_cpu(const Tensor& x, at::TensorList norms, at::ArrayRef<double> eps, at::TensorList linears,
                        at::IntArrayRef out_features, at::IntArrayRef layer_calls, const Tensor& cos,
                        const Tensor& sin, const Tensor& prefix_lens, const Tensor& tree_mask, double scale,
                        at::IntArrayRef taps, Tensor& x_out, Tensor& features, Tensor& k_cache, Tensor& v_cache) {
  constexpr const char* op = "decoder_layers_";
  const int64_t L = check_decoder_layers_inputs(Backend::CPU, op, x, norms, eps, linears, out_features, layer_calls,
                                                taps, x_out, features, k_cache, v_cache);
  for (int64_t i = 0, off = 0; i < L; off += layer_calls[i], ++i) {
    const std::string name = std::string(op) + " (layer " + std::to_string(i) + ")";
    check_decoder_layer_inputs(Backend::CPU, name.c_str(), x, x, linears.slice(2 * off, 2 * layer_calls[i]),
                               out_features.slice(off, layer_calls[i]), k_cache.select(0, i), x_out, prefix_lens,
                               tree_mask);
  }
  const int64_t H = x.size(2);
  const auto tap = [&](int64_t layer, const Tensor& h) {
    for (size_t j = 0; j < taps.size(); ++j)
      if (taps[j] == layer) features.narrow(2, static_cast<int64_t>(j) * H, H).copy_(h);
  };
  Tensor h = x;
  for (int64_t i = 0, off = 0; i < L; off += layer_calls[i], ++i) {
    tap(i, h);
    const int64_t n = layer_calls[i];
    Tensor out = i + 1 == L ? x_out : at::empty(x.sizes(), x.options());
    Tensor kc = k_cache.select(0, i), vc = v_cache.select(0, i);
    decoder_layer_cpu(h, norms[2 * i], eps[2 * i], norms[2 * i + 1], eps[2 * i + 1], linears.slice(2 * off, 2 * n),
                      out_features.slice(off, n), cos, sin, prefix_lens, tree_mask, scale, out, kc, vc, std::nullopt);
    h = out;
  }
  tap(L, x_out);
}

TORCH_LIBRARY_IMPL(heterospec, CPU, m) {
  m.impl("decoder_layer_", &decoder_layer_cpu);
  m.impl("decoder_layers_", &decoder_layers_cpu);
}

}  // namespace heterospec
