// CPU kernel: greedy_tokens (the target's greedy pick). Contract: docs/design.md, op 16.
//
// Why this exists. Greedy decoding picks, per row of logits, the first index of the maximum
// (torch.argmax; a NaN counts as the maximum). torch's CPU reduction walks a 49,152-entry row at
// about a nanosecond an element (~45 us a row on the Zen 4 box): ~0.6 % of a float32 decode step,
// and a verified tree pays it once per node (a batch of 8 requests verifying 4 nodes each, 32
// rows, ~1.4 ms a round). Two vector passes over a row the lm_head has just written (in L2) take
// a few microseconds.
//
// Layout. logits [..., V] float32 or bfloat16, read as R contiguous rows of V -> out [...] int64.
//
// Phases, per row:
//   1. one pass: the row's maximum and whether it holds a NaN (16 / 8 lanes at a time);
//   2. the answer: with a NaN, the first NaN's index; else the first index whose value equals
//      the maximum (a vector compare, stopping at the first hit). -0.0 == +0.0, so among zeros
//      the first is picked, as torch.argmax does; a row of -inf picks index 0.
// Rows are independent; many rows split over threads (parallel.h grain).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu/isa.h"
#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "op_checks.h"
#include "ops.h"

namespace heterospec {
namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Phase 2 once the maximum is known (or NaN was seen): the first index of `m` (of a NaN).
template <typename T>
int64_t first_index_scalar(const T* row, int64_t from, int64_t V, float m, bool nan) {
  for (int64_t j = from; j < V; ++j) {
    const float x = to_float(row[j]);
    if (nan ? std::isnan(x) : x == m) return j;
  }
  return 0;  // unreachable for a row that holds m (or a NaN)
}

template <typename T>
int64_t pick_scalar(const T* row, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < V; ++j) {
    const float x = to_float(row[j]);
    if (std::isnan(x)) return j;
    if (x > m) m = x;
  }
  return first_index_scalar(row, 0, V, m, false);
}

// The end of phase 1 on the vector paths: the maximum of the n lanes' maxima and of the row's
// tail past the last full vector (from .. V - 1); has_nan |= a NaN in that tail.
template <typename T>
float lanes_and_tail_max(const float* lanes, int n, const T* row, int64_t from, int64_t V, bool& has_nan) {
  float m = lanes[0];
  for (int i = 1; i < n; ++i) m = lanes[i] > m ? lanes[i] : m;
  for (int64_t t = from; t < V; ++t) {
    const float x = to_float(row[t]);
    has_nan |= std::isnan(x);
    if (x > m) m = x;
  }
  return m;
}

#ifdef HS_HAVE_X86_SIMD
template <typename T>
__attribute__((target("avx512f,avx2,fma"))) int64_t pick_avx512(const T* row, int64_t V) {
  // Phase 1: two running maxima (two independent chains) and an unordered (NaN) mask.
  __m512 m0 = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), m1 = m0;
  __mmask16 nan = 0;
  int64_t j = 0;
  for (; j + 32 <= V; j += 32) {
    const __m512 a = load16(row + j), b = load16(row + j + 16);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    m0 = _mm512_maskz_max_ps(0xFFFF, m0, a);   // (maskz: see load16)
    m1 = _mm512_maskz_max_ps(0xFFFF, m1, b);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_maskz_max_ps(0xFFFF, m0, m1));
  bool has_nan = nan != 0;
  const float m = lanes_and_tail_max(lanes, 16, row, j, V, has_nan);
  if (has_nan) return first_index_scalar(row, 0, V, m, true);
  // Phase 2: the first lane equal to the maximum.
  const __m512 vm = _mm512_set1_ps(m);
  for (j = 0; j + 16 <= V; j += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(load16(row + j), vm, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
  return first_index_scalar(row, j, V, m, false);
}

template <typename T>
__attribute__((target("avx2,fma"))) int64_t pick_avx2(const T* row, int64_t V) {
  __m256 m0 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), m1 = m0;
  __m256 nan = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= V; j += 16) {
    const __m256 a = load8(row + j), b = load8(row + j + 8);
    nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  const float m = lanes_and_tail_max(lanes, 8, row, j, V, has_nan);
  if (has_nan) return first_index_scalar(row, 0, V, m, true);
  const __m256 vm = _mm256_set1_ps(m);
  for (j = 0; j + 8 <= V; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(row + j), vm, _CMP_EQ_OQ));
    if (hit) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
  return first_index_scalar(row, j, V, m, false);
}
#endif  // HS_HAVE_X86_SIMD

template <typename T>
void pick_rows(const T* x, int64_t R, int64_t V, int64_t* out) {
  const Isa isa = active_isa();
  at::parallel_for(0, R, grain_for(V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x + r * V;
#ifdef HS_HAVE_X86_SIMD
      if (isa == Isa::Avx512) {
        out[r] = pick_avx512(row, V);
        continue;
      }
      if (isa == Isa::Avx2) {
        out[r] = pick_avx2(row, V);
        continue;
      }
#endif
      out[r] = pick_scalar(row, V);
    }
  });
}

}  // namespace

Tensor greedy_tokens_cpu(const Tensor& logits) {
  constexpr const char* op = "greedy_tokens";
  const int64_t V = check_cpu_logit_rows(op, logits);
  // [..., V] -> rows [R, V] (contiguous) -> out [...]
  const Tensor x = logits.contiguous();
  const int64_t R = x.numel() / V;
  Tensor out = at::empty(logits.sizes().slice(0, logits.dim() - 1), logits.options().dtype(at::kLong));
  if (R == 0) return out;
  int64_t* o = out.mutable_data_ptr<int64_t>();
  if (x.scalar_type() == at::kFloat)
    pick_rows(x.const_data_ptr<float>(), R, V, o);
  else
    pick_rows(x.const_data_ptr<c10::BFloat16>(), R, V, o);
  return out;
}

TORCH_LIBRARY_IMPL(heterospec, CPU, m) { m.impl("greedy_tokens", &greedy_tokens_cpu); }

}  // namespace heterospec
