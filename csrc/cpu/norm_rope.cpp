// CPU kernels: rms_norm, rope, rope_kv_write_. Contract: docs/design.md, op 11.
//
// Why this exists. A decoder layer's glue around its linears - two RMSNorms and the rotation of
// Q and K - is a handful of tiny elementwise ops per layer. At the few rows of a decode step or a
// tree verify, ATen spends far more on dispatch and thread wake-ups than on arithmetic there
// (rms_norm alone is several ops on the CPU; RoPE is six: two chunks, a negation, a cat, two
// multiplies and an add, for Q and for K). Over the target's layers that was a tenth of a
// float32 forward on the 2-core box (bench/RESULTS.md, "Layer glue as two ops"). Each op here is
// one call with one pass over its rows.
//
// Arithmetic (both ops): the rounding of the PyTorch formulas the models used before, so the
// models' outputs do not move.
//   rms_norm: y = weight * cast(x32 * 1 / sqrt(mean(x32^2) + eps)), x32 = x in float32, cast to
//     x's dtype (no-op for float32; HF Llama's RMSNorm). The sum of squares accumulates in double
//     in index order, so it may differ from ATen's reduction in the last bit.
//   rope: out = x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype,
//     exactly as the three elementwise ATen ops round them (no fused multiply-add: the file is
//     built without FMA instructions and GCC does not contract across them).
//
// Row invariance: each row (a token's hidden state, or a token's head) is computed alone, in a
// fixed order, so a row's result does not depend on how many rows share the call: a verified
// tree gets the values one-token steps would (what the lossless greedy check relies on).
//
// rope_kv_write_: what a decoder layer does between its fused QKV projection and attention, in one
// call: split the projection's output, rotate Q and K (rope's arithmetic), write K and V to the
// request's cache slots. A layer's Python for those steps was about ten ATen calls (a split, views,
// rope, per request a slice and a copy for K and for V); at one row the calls cost more than the
// work (bench/RESULTS.md, fifty-ninth session).
//
// Layouts. rms_norm: x [..., H] (any strides; rows made contiguous), weight [H] -> y [..., H]
// contiguous. rope: q [B, T, Hq, D], k [B, T, Hk, D] (any strides), cos, sin [B, T, D]
// (Rotary's tables, already scaled and cast) -> q_out, k_out contiguous, D even.
// rope_kv_write_: qkv [B, T, (Hq + 2 Hkv) D] (per token: Hq query heads, Hkv key heads, Hkv value
// heads, D values each; last stride 1), cos, sin [B, T, D], prefix_lens [B] -> q_out [B, T, Hq, D]
// (contiguous, written: the rotated queries); k_cache, v_cache [B, S, Hkv, D] (one layer's cache,
// rows of D contiguous): k_cache[b, L_b + t] = rope(k[b, t]), v_cache[b, L_b + t] = v[b, t], t < T.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "cpu/parallel.h"
#include "op_checks.h"
#include "ops.h"

namespace heterospec {
namespace {

// Round a float to the storage dtype (identity for float32; round-to-nearest-even otherwise).
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}
template <>
inline float round_to<float>(float v) {
  return v;
}

// ---- rms_norm --------------------------------------------------------------------------------
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t r0, int64_t r1, int64_t H, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * H;
    T* yr = y + r * H;
    double ss = 0.0;  // phase 1: sum of squares, in index order
    for (int64_t i = 0; i < H; ++i) {
      const double v = static_cast<float>(xr[i]);
      ss += v * v;
    }
    const float mean = static_cast<float>(ss / static_cast<double>(H));
    const float inv = 1.0f / std::sqrt(mean + eps);
    // phase 2: scale, cast to the dtype, times the weight (rounded once more)
    for (int64_t i = 0; i < H; ++i) {
      const float n = round_to<T>(static_cast<float>(xr[i]) * inv);
      yr[i] = static_cast<T>(static_cast<float>(w[i]) * n);
    }
  }
}

// ---- rope --------------------------------------------------------------------------------------
// One head row of D values: out[j] = x[j] * c[j] + rot[j] * s[j], rot = (-x[h:], x[:h]), h = D / 2.
// Each product is rounded before the sum: no contraction into a fused multiply-add (GCC contracts
// across statements by default wherever the target has FMA; the x86-64 baseline has none, other
// targets may).
#if defined(__clang__)
#define HS_NO_FP_CONTRACT _Pragma("clang fp contract(off)")
#define HS_NO_FP_CONTRACT_FN
#elif defined(__GNUC__)
#define HS_NO_FP_CONTRACT
#define HS_NO_FP_CONTRACT_FN __attribute__((optimize("fp-contract=off")))
#else
#define HS_NO_FP_CONTRACT
#define HS_NO_FP_CONTRACT_FN
#endif

template <typename T>
HS_NO_FP_CONTRACT_FN void rope_row(const T* x, const T* c, const T* s, T* out, int64_t D) {
  HS_NO_FP_CONTRACT
  const int64_t h = D / 2;
  for (int64_t j = 0; j < h; ++j) {            // first half: x * cos - x[j + h] * sin
    const float a = round_to<T>(static_cast<float>(x[j]) * static_cast<float>(c[j]));
    const float b = round_to<T>(-static_cast<float>(x[j + h]) * static_cast<float>(s[j]));
    out[j] = static_cast<T>(a + b);
  }
  for (int64_t j = h; j < D; ++j) {            // second half: x * cos + x[j - h] * sin
    const float a = round_to<T>(static_cast<float>(x[j]) * static_cast<float>(c[j]));
    const float b = round_to<T>(static_cast<float>(x[j - h]) * static_cast<float>(s[j]));
    out[j] = static_cast<T>(a + b);
  }
}

// src [B, T, H, D] with strides (stride(3) == 1), cos/sin [B, T, D] with stride(2) == 1 ->
// dst contiguous [B, T, H, D].
template <typename T>
void rope_one(const Tensor& src, const Tensor& cos, const Tensor& sin, Tensor& dst) {
  const int64_t B = src.size(0), Tn = src.size(1), H = src.size(2), D = src.size(3);
  const int64_t sb = src.stride(0), st = src.stride(1), sh = src.stride(2);
  const int64_t cb = cos.stride(0), ct = cos.stride(1), nb = sin.stride(0), nt = sin.stride(1);
  const T* xp = src.const_data_ptr<T>();
  const T* cp = cos.const_data_ptr<T>();
  const T* np = sin.const_data_ptr<T>();
  T* op = dst.mutable_data_ptr<T>();
  at::parallel_for(0, B * Tn, grain_for(H * D * 4), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / Tn, t = r % Tn;
      const T* c = cp + b * cb + t * ct;
      const T* s = np + b * nb + t * nt;
      for (int64_t hh = 0; hh < H; ++hh)
        rope_row<T>(xp + b * sb + t * st + hh * sh, c, s, op + (r * H + hh) * D, D);
    }
  });
}

// A tensor whose last dimension has stride 1 (a copy only when it has not).
Tensor unit_last_stride(const Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

}  // namespace

// x [..., H] float32 / float16 / bfloat16, weight [H] of x's dtype -> [..., H].
Tensor rms_norm_cpu(const Tensor& x_in, const Tensor& weight_in, double eps) {
  constexpr const char* op = "rms_norm";
  check_rms_norm_inputs(Backend::CPU, op, x_in, weight_in, eps);
  const Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t H = x.size(-1), M = H > 0 ? x.numel() / H : 0;
  Tensor y = at::empty(x.sizes(), x.options());
  if (M == 0 || H == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_cpu", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, M, grain_for(4 * H), [&](int64_t r0, int64_t r1) {
      rms_norm_rows<scalar_t>(xp, wp, yp, r0, r1, H, static_cast<float>(eps));
    });
  });
  return y;
}

// q [B, T, Hq, D], k [B, T, Hk, D], cos, sin [B, T, D], one float dtype -> (q_out, k_out).
std::tuple<Tensor, Tensor> rope_cpu(const Tensor& q_in, const Tensor& k_in, const Tensor& cos_in,
                                    const Tensor& sin_in) {
  constexpr const char* op = "rope";
  check_rope_inputs(Backend::CPU, op, q_in, k_in, cos_in, sin_in);
  const Tensor q = unit_last_stride(q_in), k = unit_last_stride(k_in);
  const Tensor cos = unit_last_stride(cos_in), sin = unit_last_stride(sin_in);
  Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  if (q.size(3) == 0) return {q_out, k_out};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "rope_cpu", [&] {
    if (q.numel() > 0) rope_one<scalar_t>(q, cos, sin, q_out);
    if (k.numel() > 0) rope_one<scalar_t>(k, cos, sin, k_out);
  });
  return {q_out, k_out};
}

// qkv [B, T, (Hq + 2 Hkv) D], cos, sin [B, T, D], prefix_lens [B] -> q_out [B, T, Hq, D]; K and V
// rows written to k_cache, v_cache [B, S, Hkv, D] at slots prefix_lens[b] + t.
void rope_kv_write_cpu(const Tensor& qkv_in, const Tensor& cos_in, const Tensor& sin_in, const Tensor& prefix_lens_in,
                       Tensor& q_out, Tensor& k_cache, Tensor& v_cache) {
  constexpr const char* op = "rope_kv_write_";
  check_rope_kv_write_inputs(Backend::CPU, op, qkv_in, cos_in, sin_in, prefix_lens_in, q_out, k_cache, v_cache);
  const int64_t B = qkv_in.size(0), Tn = qkv_in.size(1), Hq = q_out.size(2), Hk = k_cache.size(2);
  const int64_t S = k_cache.size(1), D = q_out.size(3);
  const Tensor prefix_lens = prefix_lens_in.contiguous();
  const int64_t* lp = prefix_lens.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B && Tn > 0; ++b)
    HS_CHECK(lp[b] >= 0 && lp[b] + Tn <= S, op, ": expected 0 <= prefix_lens[", b, "] and prefix_lens[", b,
             "] + T <= S (T = qkv.size(1) rows written after the prefix, S the cache's slots), got prefix_lens[", b,
             "] = ", lp[b], ", T = ", Tn, ", S = ", S);
  if (B == 0 || Tn == 0 || D == 0) return;
  const Tensor qkv = unit_last_stride(qkv_in), cos = unit_last_stride(cos_in), sin = unit_last_stride(sin_in);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, qkv.scalar_type(), "rope_kv_write_cpu", [&] {
    const scalar_t* xp = qkv.const_data_ptr<scalar_t>();
    const scalar_t* cp = cos.const_data_ptr<scalar_t>();
    const scalar_t* np = sin.const_data_ptr<scalar_t>();
    scalar_t* qp = q_out.mutable_data_ptr<scalar_t>();
    scalar_t* kp = k_cache.mutable_data_ptr<scalar_t>();
    scalar_t* vp = v_cache.mutable_data_ptr<scalar_t>();
    const int64_t xb = qkv.stride(0), xt = qkv.stride(1);
    const int64_t kb = k_cache.stride(0), ks = k_cache.stride(1), kh = k_cache.stride(2);
    const int64_t vb = v_cache.stride(0), vs = v_cache.stride(1), vh = v_cache.stride(2);
    at::parallel_for(0, B * Tn, grain_for((Hq + 2 * Hk) * D * 4), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / Tn, t = r % Tn, slot = lp[b] + t;
        const scalar_t* x = xp + b * xb + t * xt;       // Hq query, Hkv key, Hkv value heads of D
        const scalar_t* c = cp + b * cos.stride(0) + t * cos.stride(1);
        const scalar_t* s = np + b * sin.stride(0) + t * sin.stride(1);
        for (int64_t h = 0; h < Hq; ++h) rope_row<scalar_t>(x + h * D, c, s, qp + (r * Hq + h) * D, D);
        for (int64_t h = 0; h < Hk; ++h) {
          rope_row<scalar_t>(x + (Hq + h) * D, c, s, kp + b * kb + slot * ks + h * kh, D);
          std::copy(x + (Hq + Hk + h) * D, x + (Hq + Hk + h + 1) * D, vp + b * vb + slot * vs + h * vh);
        }
      }
    });
  });
}

TORCH_LIBRARY_IMPL(heterospec, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rope", &rope_cpu);
  m.impl("rope_kv_write_", &rope_kv_write_cpu);
}

}  // namespace heterospec
