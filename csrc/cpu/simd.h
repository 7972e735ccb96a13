// SIMD helpers shared by the CPU kernels (tree_attention, greedy_tokens, sample_tokens): loads of
// 16 (AVX-512) or 8 (AVX2) float32, bfloat16 or float16 elements as float32 (a bfloat16 is the
// top half of its float32, widened by a shift; a float16 is widened by F16C; both exact); exp of
// non-positive arguments; horizontal sums and maxima. Callers pick the path at run time (isa.h).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu/isa.h"

#ifdef HS_HAVE_X86_SIMD
namespace heterospec {

// exp(x) for x <= 0 (a score minus the row's maximum): Cephes' expf polynomial on the reduced
// argument, 2^n by the exponent bits; relative error ~1e-7. x below -87.3 gives exp(-87.3).
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

// (GCC 12's unmasked forms of several AVX-512 intrinsics warn about an undefined pass-through
// operand; the maskz forms with every lane set are the same instructions.)
constexpr __mmask16 kAll = 0xFFFF;

__attribute__((target("avx512f,avx2,fma"))) inline __m512 exp_avx512(__m512 x) {
  x = _mm512_maskz_max_ps(kAll, x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_maskz_roundscale_ps(kAll, _mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 y = _mm512_set1_ps(kP0);
  for (float c : {kP1, kP2, kP3, kP4, kP5}) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e =
      _mm512_maskz_slli_epi32(kAll, _mm512_add_epi32(_mm512_maskz_cvtps_epi32(kAll, n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 y = _mm256_set1_ps(kP0);
  for (float c : {kP1, kP2, kP3, kP4, kP5}) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

__attribute__((target("avx2,fma"))) inline float hmax_avx2(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Horizontal sum and maximum of 16 lanes in a fixed order: 256-bit halves, 128-bit quarters, then SSE.
__attribute__((target("avx512f,avx2,fma"))) inline float hsum_avx512(__m512 v) {
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(kAll, v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(kAll, v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m128 s = _mm512_maskz_extractf32x4_ps(__mmask8(0xF), v, 0), t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

__attribute__((target("avx512f,avx2,fma"))) inline float hmax_avx512(__m512 v) {
  v = _mm512_maskz_max_ps(kAll, v, _mm512_maskz_shuffle_f32x4(kAll, v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_maskz_max_ps(kAll, v, _mm512_maskz_shuffle_f32x4(kAll, v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m128 s = _mm512_maskz_extractf32x4_ps(__mmask8(0xF), v, 0), t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}

__attribute__((target("avx512f,avx2,fma"), always_inline)) inline __m512 load16(const float* x) {
  return _mm512_loadu_ps(x);
}
__attribute__((target("avx512f,avx2,fma"), always_inline)) inline __m512 load16(const c10::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll, _mm512_maskz_cvtepu16_epi32(kAll, h), 16));
}
__attribute__((target("avx512f,avx2,fma"), always_inline)) inline __m512 load16(const c10::Half* x) {
  return _mm512_maskz_cvtph_ps(kAll, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
__attribute__((target("avx2,fma"), always_inline)) inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
__attribute__((target("avx2,fma"), always_inline)) inline __m256 load8(const c10::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 load8(const c10::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}

}  // namespace heterospec
#endif  // HS_HAVE_X86_SIMD
