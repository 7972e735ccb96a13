// CPU kernels: stream_linear_pack, stream_linear. Contract: docs/design.md, op 10.
//
// Why this exists. Speculative decoding pays only if the target verifies a tree of T tokens in
// about the time it decodes one: a decode step is bound by reading the weights, and T rows should
// reuse each weight as it streams by. CPU BLAS breaks that for small T: sgemm re-reads or
// re-packs the weights per call, so a float32 linear at 8 rows costs far more than at one
// (bench/RESULTS.md, "stream_linear"). This kernel reads each weight exactly once per call for up
// to MR_MAX rows at a time, whatever the row count, with the row block's partial sums in registers.
//
// Layout (stream_linear_pack). weight [N, K] float32 or bfloat16 (nn.Linear: out x in) ->
// packed [P, K, kBlock] of the same dtype, P = ceil(N / kBlock): block p holds outputs
// kBlock*p .. +kBlock-1, and for each input index k their kBlock weights are contiguous, so one
// block is one sequential stream of memory. Outputs past N are zero.
//
// bfloat16. The same kernel with half the bytes to stream: each bfloat16 weight widens exactly
// to float32 in registers and joins the same float32 FMA chain; a bfloat16 x is widened first and
// the float32 result (bias included) is rounded to bfloat16 once. No native bf16 instructions are
// needed, so an AVX2-only CPU streams bfloat16 weights as well.
//
// float16 weights, float32 x. A float32 weight whose values are all float16 values (a model stored
// in float16, like the shipped draft, loaded in float32) streams as float16: each weight widens
// exactly (F16C), the same float32 chain, a float32 result - stream_linear's float32 bits from
// half the bytes.
//
// Phases (stream_linear). x [M, K] -> y [M, N]:
//   1. split the P blocks evenly over the threads (each task streams its own blocks);
//   2. per block, the M rows in balanced chunks of <= MR_MAX (12 AVX-512, 6 AVX2, 4 portable):
//      the micro-kernel keeps rows x kBlock accumulators in registers and walks k once,
//      prefetching the block ahead (later chunks re-read the block from L2). AVX2 has room for
//      rows x 16 accumulators only, so it walks k twice, a half block each time, except for 1-2
//      rows: there the whole block in one pass gives each row four FMA chains to interleave
//      instead of two (a one-row step waited on the FMA latency);
//   3. masked store of the block's outputs (the last block may be partial); bias added after.
//
// Row invariance. Every output y[m, n] is one chain of fused multiply-adds over k = 0..K-1 in
// order, starting from 0, whatever M, the chunking, the thread count or the instruction set
// (AVX-512, AVX2 and the portable loop compute the same chain). So a row's result does not depend
// on the rows beside it: a tree verified in one call gets, bit for bit, the outputs a one-token
// decode step would give its tokens (given the same inputs).
//
// Blocks (stream_linear_blocks). A float32 weight that came from a block-quantised file (GGUF
// Q4_1: w = d * q + m, q in 0..15; Q8_0: w = d * q, q in -128..127; d, m float16 per 32 inputs of
// one output) holds exactly those values, so it can stream as its codes: 4 or 8 bits per weight
// instead of 32. Each code widens in registers to w = fma(q, d, m) - d * q is exact in float32
// (an 11-bit by at most 8-bit product), so the one rounding of the fma gives the float32 weight
// bit for bit - and joins the same FMA chain as above. The outputs therefore equal stream_linear's
// on the float32 weight exactly (row-invariant too); only the bytes read differ. Rows beyond one
// chunk (AVX2: > 6, AVX-512: > 12) widen each group of a block's codes once into an L1 buffer that
// every chunk then reads (blocks_widened), instead of widening them again per chunk.
//   codes  [P, K, 16] uint8 (Q4_1: byte j = output j in the low nibble, output j + 16 in the high)
//       or [P, K, 32] int8  (Q8_0: byte j = output j),
//   scales [P, K / 32, 2, 32] float32: per block and group of 32 inputs, d of the 32 outputs, then m
//       (0 for Q8_0). heterospec.ops.stream_linear_pack_blocks finds the codes of a float32 weight.
// A bfloat16 x takes the bfloat16 weight those codes give when rounded (a model converted from the
// file in float32 and cast to bfloat16): each widened weight is rounded to bfloat16 in registers
// (round to nearest even, as torch's cast), then the same float32 chain, the result rounded once.
// So the outputs equal stream_linear's on that bfloat16 weight bit for bit, from 4 or 8 bits a
// weight instead of 16.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/isa.h"
#include "cpu/parallel.h"
#include "op_checks.h"
#include "ops.h"

namespace heterospec {
namespace {

constexpr int64_t kBlock = 32;      // outputs per packed block (two AVX-512 / four AVX2 vectors)
constexpr int64_t kPrefetch = 16;   // k steps ahead the micro-kernel prefetches (2 KiB of a block)
constexpr int kOnePassRows = 2;     // AVX2: rows a whole-block pass serves (4 MR accumulators of 16 registers)

// Rows of the next chunk when `left` rows remain and a chunk holds at most `most`: the remaining
// rows in balanced chunks (13 rows at 12: 7 + 6, not 12 + 1).
inline int64_t chunk_rows(int64_t left, int64_t most) {
  const int64_t chunks = (left + most - 1) / most;
  return (left + chunks - 1) / chunks;
}

// ---- micro-kernels -----------------------------------------------------------------------------
// One call: MR rows of x (row stride ldx) times one packed block (K x kBlock) of weights of type W
// (float, or bfloat16 held as uint16_t) -> y's columns n0 .. n0 + kBlock - 1 (stride ldy), only
// the first `valid` of them stored. x and y are float32 (a bfloat16 call converts x exactly before
// and rounds y once after); a bfloat16 weight widens exactly to float32 (its bits shifted left by
// 16), so both weight types run the same FMA chain over float32 values.
template <typename W>
using MicroFn = void (*)(const float* x, int64_t ldx, const W* blk, int64_t K, float* y, int64_t ldy, int64_t valid);

// A float16 weight's bits (a distinct type from bfloat16's uint16_t).
struct F16Bits {
  uint16_t bits;
};

inline float widen(float w) { return w; }
inline float widen(F16Bits w) { return c10::detail::fp16_ieee_to_fp32_value(w.bits); }
inline float widen(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename W, int MR>
void micro_scalar(const float* x, int64_t ldx, const W* blk, int64_t K, float* y, int64_t ldy, int64_t valid) {
  float acc[MR][kBlock] = {};
  for (int64_t k = 0; k < K; ++k) {
    const W* w = blk + k * kBlock;
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * ldx + k];
      for (int64_t j = 0; j < kBlock; ++j) acc[m][j] = std::fma(xv, widen(w[j]), acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(y + m * ldy, acc[m], sizeof(float) * valid);
}

#ifdef HS_HAVE_X86_SIMD
// 16 weights as one AVX-512 vector of float32.
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const uint16_t* w) {
  // (maskz forms: GCC 12 warns about the plain forms' undefined pass-through register)
  const __m512i wide =
      _mm512_maskz_cvtepu16_epi32(static_cast<__mmask16>(0xFFFF), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(static_cast<__mmask16>(0xFFFF), wide, 16));
}
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const F16Bits* w) {
  return _mm512_maskz_cvtph_ps(static_cast<__mmask16>(0xFFFF), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
// 8 weights as one AVX2 vector of float32.
__attribute__((target("avx2"), always_inline)) inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
__attribute__((target("avx2,f16c"), always_inline)) inline __m256 load8(const F16Bits* w) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}
__attribute__((target("avx2"), always_inline)) inline __m256 load8(const uint16_t* w) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// The chain's step shared by every AVX-512 kernel: MR rows' accumulators += x[m, k] * (w0 | w1).
template <int MR>
__attribute__((target("avx512f,fma"), always_inline)) inline void rows_fma_avx512(__m512 (&acc)[MR][2], const float* x,
                                                                                 int64_t ldx, int64_t k, __m512 w0,
                                                                                 __m512 w1) {
  for (int m = 0; m < MR; ++m) {
    const __m512 b = _mm512_set1_ps(x[m * ldx + k]);
    acc[m][0] = _mm512_fmadd_ps(b, w0, acc[m][0]);
    acc[m][1] = _mm512_fmadd_ps(b, w1, acc[m][1]);
  }
}
// Masked store of a block's first `valid` outputs for MR rows.
template <int MR>
__attribute__((target("avx512f"), always_inline)) inline void store_avx512(__m512 (&acc)[MR][2], float* y, int64_t ldy,
                                                                          int64_t valid) {
  for (int h = 0; h < 2; ++h) {
    const int64_t left = valid - 16 * h;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * ldy + 16 * h, mask, acc[m][h]);
  }
}
// The same for AVX2's half blocks: outputs 16 h .. 16 h + 15 as two vectors of 8.
template <int MR>
__attribute__((target("avx2,fma"), always_inline)) inline void rows_fma_avx2(__m256 (&acc)[MR][2], const float* x,
                                                                            int64_t ldx, int64_t k, __m256 w0,
                                                                            __m256 w1) {
  for (int m = 0; m < MR; ++m) {
    const __m256 b = _mm256_broadcast_ss(x + m * ldx + k);
    acc[m][0] = _mm256_fmadd_ps(b, w0, acc[m][0]);
    acc[m][1] = _mm256_fmadd_ps(b, w1, acc[m][1]);
  }
}
template <int MR>
__attribute__((target("avx2"), always_inline)) inline void store_half_avx2(__m256 (&acc)[MR][2], float* y, int64_t ldy,
                                                                           int64_t left) {
  for (int m = 0; m < MR; ++m) {
    float* out = y + m * ldy;
    if (left == 16) {
      _mm256_storeu_ps(out, acc[m][0]);
      _mm256_storeu_ps(out + 8, acc[m][1]);
    } else {
      alignas(32) float tmp[16];
      _mm256_store_ps(tmp, acc[m][0]);
      _mm256_store_ps(tmp + 8, acc[m][1]);
      std::memcpy(out, tmp, sizeof(float) * left);
    }
  }
}
// A whole block's 4 vectors per row (one-pass kernels): outputs 0..15, then 16..31 where valid.
// (Constant indices only: an accumulator indexed at run time lives in memory, stored every step.)
template <int MR>
__attribute__((target("avx2"), always_inline)) inline void store_one_pass_avx2(__m256 (&acc)[MR][4], float* y,
                                                                               int64_t ldy, int64_t valid) {
  __m256 lo[MR][2], hi[MR][2];
  for (int m = 0; m < MR; ++m) lo[m][0] = acc[m][0], lo[m][1] = acc[m][1], hi[m][0] = acc[m][2], hi[m][1] = acc[m][3];
  store_half_avx2<MR>(lo, y, ldy, std::min<int64_t>(valid, 16));
  if (valid > 16) store_half_avx2<MR>(hi, y + 16, ldy, valid - 16);
}

// AVX-512: MR rows x 2 vectors of 16 (2 * MR <= 24 accumulators of 32 registers).
template <typename W, int MR>
__attribute__((target("avx512f,fma"))) void micro_avx512(const float* x, int64_t ldx, const W* blk, int64_t K,
                                                         float* y, int64_t ldy, int64_t valid) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const W* w = blk + k * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch * kBlock), _MM_HINT_T0);
    if (sizeof(W) == 4) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch * kBlock + 16), _MM_HINT_T0);
    rows_fma_avx512<MR>(acc, x, ldx, k, load16(w), load16(w + 16));
  }
  store_avx512<MR>(acc, y, ldy, valid);
}

// AVX2: 16 registers, so half a block (2 vectors of 8) at a time: MR rows x 2 (<= 12
// accumulators). The second half re-reads the block's other cache lines from L2.
template <typename W, int MR>
__attribute__((target("avx2,fma,f16c"))) void micro_avx2(const float* x, int64_t ldx, const W* blk, int64_t K,
                                                    float* y, int64_t ldy, int64_t valid) {
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const W* wh = blk + 16 * h;
    for (int64_t k = 0; k < K; ++k) {
      const W* w = wh + k * kBlock;
      if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch * kBlock), _MM_HINT_T0);
      if (h == 0 && sizeof(W) == 4) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch * kBlock + 16), _MM_HINT_T0);
      rows_fma_avx2<MR>(acc, x, ldx, k, load8(w), load8(w + 8));
    }
    const int64_t left = std::min<int64_t>(valid - 16 * h, 16);
    if (left <= 0) break;
    store_half_avx2<MR>(acc, y + 16 * h, ldy, left);
  }
}

// AVX2, one or two rows: the whole block in one pass (4 MR accumulators), four FMA chains per row
// instead of two, as blocks_avx2_one_pass below; the same chains, so the same bits.
template <typename W, int MR>
__attribute__((target("avx2,fma,f16c"))) void micro_avx2_one_pass(const float* x, int64_t ldx, const W* blk, int64_t K,
                                                             float* y, int64_t ldy, int64_t valid) {
  __m256 acc[MR][4];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const W* w = blk + k * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch * kBlock), _MM_HINT_T0);
    if (sizeof(W) == 4) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch * kBlock + 16), _MM_HINT_T0);
    const __m256 w0 = load8(w), w1 = load8(w + 8), w2 = load8(w + 16), w3 = load8(w + 24);
    for (int m = 0; m < MR; ++m) {
      const __m256 b = _mm256_broadcast_ss(x + m * ldx + k);
      acc[m][0] = _mm256_fmadd_ps(b, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(b, w1, acc[m][1]);
      acc[m][2] = _mm256_fmadd_ps(b, w2, acc[m][2]);
      acc[m][3] = _mm256_fmadd_ps(b, w3, acc[m][3]);
    }
  }
  store_one_pass_avx2<MR>(acc, y, ldy, valid);
}

// ---- block-coded weights (stream_linear_blocks) ------------------------------------------------
// Same register blocking as above; per group of kGroup inputs the block's d and m (2 x 32 floats)
// stay in registers (AVX-512) or L1 (AVX2), and each k step widens 32 codes into two / four
// vectors of exact float32 weights.
constexpr int64_t kGroup = 32;   // inputs per scale group (the GGUF block)

template <bool kQ4>
constexpr int64_t code_bytes() { return kQ4 ? 16 : 32; }

// 16 codes -> their float32 q: outputs lo .. lo + 15 of the block (Q4_1: `high` picks the nibble).
__attribute__((target("avx512f"), always_inline)) inline __m512 q16_avx512_q4(const uint8_t* c, bool high) {
  const __mmask16 all = static_cast<__mmask16>(0xFFFF);
  const __m512i v = _mm512_maskz_cvtepu8_epi32(all, _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  const __m512i q = high ? _mm512_maskz_srli_epi32(all, v, 4) : _mm512_maskz_and_epi32(all, v, _mm512_set1_epi32(15));
  return _mm512_maskz_cvtepi32_ps(all, q);
}
__attribute__((target("avx512f"), always_inline)) inline __m512 q16_avx512_q8(const uint8_t* c) {
  const __mmask16 all = static_cast<__mmask16>(0xFFFF);
  return _mm512_maskz_cvtepi32_ps(all, _mm512_maskz_cvtepi8_epi32(all, _mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
}

// Round 16 float32 weights to bfloat16 values (nearest even; the weights are finite), as float32.
__attribute__((target("avx512f"), always_inline)) inline __m512 round_bf16_avx512(__m512 w) {
  const __mmask16 all = static_cast<__mmask16>(0xFFFF);
  const __m512i bits = _mm512_castps_si512(w);
  const __m512i odd = _mm512_maskz_and_epi32(all, _mm512_maskz_srli_epi32(all, bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_maskz_add_epi32(all, bits, _mm512_maskz_add_epi32(all, odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_maskz_and_epi32(all, up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
template <bool kBf16>
__attribute__((target("avx512f"), always_inline)) inline __m512 held_avx512(__m512 w) {
  return kBf16 ? round_bf16_avx512(w) : w;
}

template <bool kQ4, bool kBf16, int MR>
__attribute__((target("avx512f,fma"))) void blocks_avx512(const float* x, int64_t ldx, const uint8_t* codes,
                                                          const float* scales, int64_t K, float* y, int64_t ldy,
                                                          int64_t valid) {
  constexpr int64_t cb = code_bytes<kQ4>();
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float* s = scales + g * 2 * kBlock;
    const __m512 d0 = _mm512_loadu_ps(s), d1 = _mm512_loadu_ps(s + 16);
    const __m512 m0 = _mm512_loadu_ps(s + 32), m1 = _mm512_loadu_ps(s + 48);
    for (int64_t kk = 0; kk < kGroup; ++kk) {
      const int64_t k = g * kGroup + kk;
      const uint8_t* c = codes + k * cb;
      _mm_prefetch(reinterpret_cast<const char*>(c + 4 * kPrefetch * cb), _MM_HINT_T0);
      const __m512 q0 = kQ4 ? q16_avx512_q4(c, false) : q16_avx512_q8(c);
      const __m512 q1 = kQ4 ? q16_avx512_q4(c, true) : q16_avx512_q8(c + 16);
      rows_fma_avx512<MR>(acc, x, ldx, k, held_avx512<kBf16>(_mm512_fmadd_ps(q0, d0, m0)),
                          held_avx512<kBf16>(_mm512_fmadd_ps(q1, d1, m1)));
    }
  }
  store_avx512<MR>(acc, y, ldy, valid);
}

// 8 codes -> their float32 q (Q4_1: `high` picks the nibble).
__attribute__((target("avx2"), always_inline)) inline __m256 q8_avx2_q4(const uint8_t* c, bool high) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
  return _mm256_cvtepi32_ps(high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15)));
}
__attribute__((target("avx2"), always_inline)) inline __m256 q8_avx2_q8(const uint8_t* c) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
}

// Round 8 float32 weights to bfloat16 values (as round_bf16_avx512).
__attribute__((target("avx2"), always_inline)) inline __m256 round_bf16_avx2(__m256 w) {
  const __m256i bits = _mm256_castps_si256(w);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
template <bool kBf16>
__attribute__((target("avx2"), always_inline)) inline __m256 held_avx2(__m256 w) {
  return kBf16 ? round_bf16_avx2(w) : w;
}

// AVX2: half a block (outputs 16 h .. 16 h + 15) at a time, as micro_avx2.
template <bool kQ4, bool kBf16, int MR>
__attribute__((target("avx2,fma"))) void blocks_avx2(const float* x, int64_t ldx, const uint8_t* codes,
                                                     const float* scales, int64_t K, float* y, int64_t ldy,
                                                     int64_t valid) {
  constexpr int64_t cb = code_bytes<kQ4>();
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / kGroup; ++g) {
      const float* s = scales + g * 2 * kBlock + 16 * h;
      const __m256 d0 = _mm256_loadu_ps(s), d1 = _mm256_loadu_ps(s + 8);
      const __m256 m0 = _mm256_loadu_ps(s + 32), m1 = _mm256_loadu_ps(s + 40);
      for (int64_t kk = 0; kk < kGroup; ++kk) {
        const int64_t k = g * kGroup + kk;
        const uint8_t* c = codes + k * cb;
        if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(c + 4 * kPrefetch * cb), _MM_HINT_T0);
        // Q4_1: outputs 0..15 are the low nibbles of bytes 0..15, outputs 16..31 the high ones;
        // Q8_0: outputs 16 h + i are bytes 16 h + i.
        const __m256 q0 = kQ4 ? q8_avx2_q4(c, h == 1) : q8_avx2_q8(c + 16 * h);
        const __m256 q1 = kQ4 ? q8_avx2_q4(c + 8, h == 1) : q8_avx2_q8(c + 16 * h + 8);
        rows_fma_avx2<MR>(acc, x, ldx, k, held_avx2<kBf16>(_mm256_fmadd_ps(q0, d0, m0)),
                          held_avx2<kBf16>(_mm256_fmadd_ps(q1, d1, m1)));
      }
    }
    const int64_t left = std::min<int64_t>(valid - 16 * h, 16);
    if (left <= 0) break;
    store_half_avx2<MR>(acc, y + 16 * h, ldy, left);
  }
}

// AVX2, few rows: the whole block in one pass, four vectors of 8 outputs (4 MR accumulators),
// so each k step feeds four independent FMA chains per row. In the half-block passes above a
// one-row call has two chains, each waiting on the FMA latency at every step, and streamed well
// below the memory's speed (bench/RESULTS.md, sixtieth session). The chains, their order and the
// weights' values are the half-block kernel's: the same bits.
template <bool kQ4, bool kBf16, int MR>
__attribute__((target("avx2,fma"), always_inline)) inline void one_pass_step(__m256 (&acc)[MR][4], const float* x,
                                                                            int64_t ldx, int64_t k, const uint8_t* c,
                                                                            const float* s) {
  _mm_prefetch(reinterpret_cast<const char*>(c + 4 * kPrefetch * code_bytes<kQ4>()), _MM_HINT_T0);
  __m256 b[MR];
  for (int m = 0; m < MR; ++m) b[m] = _mm256_broadcast_ss(x + m * ldx + k);
  for (int h = 0; h < 2; ++h) {
    const __m256 q0 = kQ4 ? q8_avx2_q4(c, h == 1) : q8_avx2_q8(c + 16 * h);
    const __m256 q1 = kQ4 ? q8_avx2_q4(c + 8, h == 1) : q8_avx2_q8(c + 16 * h + 8);
    const __m256 w0 = held_avx2<kBf16>(_mm256_fmadd_ps(q0, _mm256_loadu_ps(s + 16 * h), _mm256_loadu_ps(s + 32 + 16 * h)));
    const __m256 w1 = held_avx2<kBf16>(_mm256_fmadd_ps(q1, _mm256_loadu_ps(s + 16 * h + 8), _mm256_loadu_ps(s + 40 + 16 * h)));
    for (int m = 0; m < MR; ++m) {
      acc[m][2 * h] = _mm256_fmadd_ps(b[m], w0, acc[m][2 * h]);
      acc[m][2 * h + 1] = _mm256_fmadd_ps(b[m], w1, acc[m][2 * h + 1]);
    }
  }
}

template <bool kQ4, bool kBf16, int MR>
__attribute__((target("avx2,fma"))) void blocks_avx2_one_pass(const float* x, int64_t ldx, const uint8_t* codes,
                                                              const float* scales, int64_t K, float* y, int64_t ldy,
                                                              int64_t valid) {
  constexpr int64_t cb = code_bytes<kQ4>();
  __m256 acc[MR][4];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = _mm256_setzero_ps();
  if constexpr (MR == 1) {
    // a group's 8 scale vectors stay in registers beside one row's 4 accumulators
    for (int64_t g = 0; g < K / kGroup; ++g)
      for (int64_t kk = 0; kk < kGroup; ++kk)
        one_pass_step<kQ4, kBf16, MR>(acc, x, ldx, g * kGroup + kk, codes + (g * kGroup + kk) * cb,
                                      scales + g * 2 * kBlock);
  } else {
    // one flat k loop, the scales read from L1 at each step: held for a group they pushed an
    // accumulator of two Q4_1 rows onto the stack (a store-to-load wait in its chain)
    for (int64_t k = 0; k < K; ++k)
      one_pass_step<kQ4, kBf16, MR>(acc, x, ldx, k, codes + k * cb, scales + (k / kGroup) * 2 * kBlock);
  }
  store_one_pass_avx2<MR>(acc, y, ldy, valid);
}

// More rows than one chunk (AVX2: > 6, AVX-512: > 12): widen once, then multiply. The kernels
// above widen each code again for every chunk of rows (and on AVX2 for each half block), and the
// widening's converts and fmas share the FMA ports with the rows' chains. Here a block's codes
// are widened one group (kGroup inputs) at a time into a 4 KiB buffer of float32 weights in L1,
// and every chunk of rows then runs over that buffer: per step two weight loads and 2 MR FMAs
// (AVX2: half blocks, 15 registers). Between groups a chunk's partial sums wait in a scratch of
// float32 (stored and reloaded exactly), so each output is still the one chain over
// k = 0..K-1 of the kernels above: the same bits. Up to one chunk the in-register kernels stay
// faster (no buffer's stores and reloads).
constexpr int64_t kWidenRows = 96;   // rows of one widened pass (12 KiB of partial sums beside the buffer)

// One group's codes -> wbuf [kGroup, kBlock] float32 (s: the group's d then m, 32 each).
template <bool kQ4, bool kBf16>
__attribute__((target("avx2,fma"))) void widen_group_avx2(const uint8_t* codes, const float* s, float* wbuf) {
  constexpr int64_t cb = code_bytes<kQ4>();
  __m256 d[4], m[4];
  for (int v = 0; v < 4; ++v) d[v] = _mm256_loadu_ps(s + 8 * v), m[v] = _mm256_loadu_ps(s + 32 + 8 * v);
  for (int64_t kk = 0; kk < kGroup; ++kk) {
    const uint8_t* c = codes + kk * cb;
    _mm_prefetch(reinterpret_cast<const char*>(c + kGroup * cb), _MM_HINT_T0);
    for (int v = 0; v < 4; ++v) {   // outputs 8 v .. 8 v + 7 (Q4_1: nibble v / 2 of bytes 8 (v % 2) ..)
      const __m256 q = kQ4 ? q8_avx2_q4(c + 8 * (v % 2), v >= 2) : q8_avx2_q8(c + 8 * v);
      _mm256_store_ps(wbuf + kk * kBlock + 8 * v, held_avx2<kBf16>(_mm256_fmadd_ps(q, d[v], m[v])));
    }
  }
}
template <bool kQ4, bool kBf16>
__attribute__((target("avx512f,fma"))) void widen_group_avx512(const uint8_t* codes, const float* s, float* wbuf) {
  constexpr int64_t cb = code_bytes<kQ4>();
  const __m512 d[2] = {_mm512_loadu_ps(s), _mm512_loadu_ps(s + 16)};
  const __m512 m[2] = {_mm512_loadu_ps(s + 32), _mm512_loadu_ps(s + 48)};
  for (int64_t kk = 0; kk < kGroup; ++kk) {
    const uint8_t* c = codes + kk * cb;
    _mm_prefetch(reinterpret_cast<const char*>(c + kGroup * cb), _MM_HINT_T0);
    for (int v = 0; v < 2; ++v) {
      const __m512 q = kQ4 ? q16_avx512_q4(c, v == 1) : q16_avx512_q8(c + 16 * v);
      _mm512_store_ps(wbuf + kk * kBlock + 16 * v, held_avx512<kBf16>(_mm512_fmadd_ps(q, d[v], m[v])));
    }
  }
}

// MR rows' partial sums (part: rows of kBlock floats) += x's kGroup inputs times the buffer.
template <int MR>
__attribute__((target("avx2,fma"))) void group_rows_avx2(const float* x, int64_t ldx, const float* wbuf, float* part) {
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR][2];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < 2; ++v) acc[m][v] = _mm256_load_ps(part + m * kBlock + 16 * h + 8 * v);
    for (int64_t kk = 0; kk < kGroup; ++kk)
      rows_fma_avx2<MR>(acc, x, ldx, kk, _mm256_load_ps(wbuf + kk * kBlock + 16 * h),
                        _mm256_load_ps(wbuf + kk * kBlock + 16 * h + 8));
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < 2; ++v) _mm256_store_ps(part + m * kBlock + 16 * h + 8 * v, acc[m][v]);
  }
}
template <int MR>
__attribute__((target("avx512f,fma"))) void group_rows_avx512(const float* x, int64_t ldx, const float* wbuf,
                                                             float* part) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2; ++v) acc[m][v] = _mm512_load_ps(part + m * kBlock + 16 * v);
  for (int64_t kk = 0; kk < kGroup; ++kk)
    rows_fma_avx512<MR>(acc, x, ldx, kk, _mm512_load_ps(wbuf + kk * kBlock), _mm512_load_ps(wbuf + kk * kBlock + 16));
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2; ++v) _mm512_store_ps(part + m * kBlock + 16 * v, acc[m][v]);
}

using WidenFn = void (*)(const uint8_t*, const float*, float*);
using GroupRowsFn = void (*)(const float*, int64_t, const float*, float*);
struct WidenedKernels {
  WidenFn widen;
  GroupRowsFn rows[13];   // by chunk rows 1 .. chunk
  int chunk;
};
template <bool kQ4, bool kBf16>
const WidenedKernels& widened_kernels(Isa isa) {
  static const WidenedKernels avx2 = {widen_group_avx2<kQ4, kBf16>,
                                      {nullptr, group_rows_avx2<1>, group_rows_avx2<2>, group_rows_avx2<3>,
                                       group_rows_avx2<4>, group_rows_avx2<5>, group_rows_avx2<6>},
                                      6};
  static const WidenedKernels avx512 = {
      widen_group_avx512<kQ4, kBf16>,
      {nullptr, group_rows_avx512<1>, group_rows_avx512<2>, group_rows_avx512<3>, group_rows_avx512<4>,
       group_rows_avx512<5>, group_rows_avx512<6>, group_rows_avx512<7>, group_rows_avx512<8>, group_rows_avx512<9>,
       group_rows_avx512<10>, group_rows_avx512<11>, group_rows_avx512<12>},
      12};
  return isa == Isa::Avx512 ? avx512 : avx2;
}

// M (<= kWidenRows) rows times one block of codes: widen a group, run every chunk of rows over it.
inline void blocks_widened(const WidenedKernels& ks, const float* x, int64_t ldx, int64_t M, const uint8_t* codes,
                           int64_t code_bytes, const float* scales, int64_t K, float* y, int64_t ldy, int64_t valid) {
  alignas(64) float wbuf[kGroup * kBlock];
  alignas(64) float part[kWidenRows * kBlock];
  std::memset(part, 0, sizeof(float) * M * kBlock);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    ks.widen(codes + g * kGroup * code_bytes, scales + g * 2 * kBlock, wbuf);
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t mr = chunk_rows(M - m0, ks.chunk);
      ks.rows[mr](x + m0 * ldx + g * kGroup, ldx, wbuf, part + m0 * kBlock);
      m0 += mr;
    }
  }
  for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * ldy, part + m * kBlock, sizeof(float) * valid);
}
#endif  // HS_HAVE_X86_SIMD

// The portable loop: the same q, the same fma to the weight, the same chain.
template <bool kQ4, bool kBf16, int MR>
void blocks_scalar(const float* x, int64_t ldx, const uint8_t* codes, const float* scales, int64_t K, float* y,
                   int64_t ldy, int64_t valid) {
  constexpr int64_t cb = code_bytes<kQ4>();
  float acc[MR][kBlock] = {};
  for (int64_t k = 0; k < K; ++k) {
    const uint8_t* c = codes + k * cb;
    const float* s = scales + (k / kGroup) * 2 * kBlock;
    float w[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) {
      const float q = kQ4 ? static_cast<float>(j < 16 ? (c[j] & 15) : (c[j - 16] >> 4))
                          : static_cast<float>(static_cast<int8_t>(c[j]));
      w[j] = std::fma(q, s[j], s[kBlock + j]);
      if (kBf16) w[j] = static_cast<float>(c10::BFloat16(w[j]));   // (c10's round to nearest even)
    }
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * ldx + k];
      for (int64_t j = 0; j < kBlock; ++j) acc[m][j] = std::fma(xv, w[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(y + m * ldy, acc[m], sizeof(float) * valid);
}

using BlocksFn = void (*)(const float*, int64_t, const uint8_t*, const float*, int64_t, float*, int64_t, int64_t);

struct BlockKernels {
  BlocksFn fn[13];   // by row count 1 .. mr_max
  int mr_max;
};

template <bool kQ4, bool kBf16, template <bool, bool, int> class Wrap>
BlockKernels make_block_kernels(int mr_max) {
  return {{nullptr, Wrap<kQ4, kBf16, 1>::fn, Wrap<kQ4, kBf16, 2>::fn, Wrap<kQ4, kBf16, 3>::fn, Wrap<kQ4, kBf16, 4>::fn,
           Wrap<kQ4, kBf16, 5>::fn, Wrap<kQ4, kBf16, 6>::fn, Wrap<kQ4, kBf16, 7>::fn, Wrap<kQ4, kBf16, 8>::fn,
           Wrap<kQ4, kBf16, 9>::fn, Wrap<kQ4, kBf16, 10>::fn, Wrap<kQ4, kBf16, 11>::fn, Wrap<kQ4, kBf16, 12>::fn},
          mr_max};
}
template <bool kQ4, bool kBf16, int MR>
struct BlocksScalarK {
  static constexpr BlocksFn fn = blocks_scalar<kQ4, kBf16, MR>;
};
#ifdef HS_HAVE_X86_SIMD
template <bool kQ4, bool kBf16, int MR>
struct BlocksAvx512K {
  static constexpr BlocksFn fn = blocks_avx512<kQ4, kBf16, MR>;
};
template <bool kQ4, bool kBf16, int MR>
struct BlocksAvx2K {   // one pass over the block where its accumulators fit, else halves
  static constexpr BlocksFn fn = MR <= kOnePassRows
                                     ? blocks_avx2_one_pass<kQ4, kBf16, (MR <= kOnePassRows ? MR : 1)>
                                     : blocks_avx2<kQ4, kBf16, MR>;
};
#endif

// kBf16: the weights rounded to bfloat16 (a bfloat16 x).
template <bool kQ4, bool kBf16 = false>
const BlockKernels& block_kernels_for(Isa isa) {
  static const BlockKernels scalar = make_block_kernels<kQ4, kBf16, BlocksScalarK>(4);
#ifdef HS_HAVE_X86_SIMD
  static const BlockKernels avx512 = make_block_kernels<kQ4, kBf16, BlocksAvx512K>(12);
  static const BlockKernels avx2 = make_block_kernels<kQ4, kBf16, BlocksAvx2K>(6);
  if (isa == Isa::Avx512) return avx512;
  if (isa == Isa::Avx2) return avx2;
#endif
  (void)isa;
  return scalar;
}

// The instruction set the block kernels of a 1- or 2-row call run with. On an AVX-512 CPU that
// executes a 512-bit instruction as two 256-bit halves (AMD Zen 4) the AVX2 one-pass kernels -
// four FMA chains per row of half the width - ran a one-token step's linears ~12 % faster and a
// two-token step's ~10 % (bench/RESULTS.md, sixty-second session); on a CPU with full-width
// 512-bit units the AVX-512 kernels may win. Both compute the same chains (the same bits), so
// the choice is measured, once per process and format: the two one-row kernels on one synthetic
// weight that stays in L2 (a one-row call is bound by its instructions), interleaved, best of
// kTrials (~10 ms at the first call); AVX2 where it is kMargin faster. Two-row calls follow that
// verdict: timed alone in L2 the two-row kernels ranked level, while in the model's two-token
// step AVX2 was the faster. HETEROSPEC_SMALL_ROWS_ISA=avx512 or avx2 fixes the choice (A/B runs,
// tests).
template <bool kQ4>
Isa measured_one_row_isa() {
  constexpr int64_t K = 576, P = 24;   // 768 outputs (Q4_1: 221 KB of codes, Q8_0: 442 KB)
  constexpr int kTrials = 15;
  constexpr double kMargin = 0.97;
  const int64_t cb = code_bytes<kQ4>(), bs = (K / kGroup) * 2 * kBlock;
  std::vector<uint8_t> codes(P * K * cb, 0x5A);
  std::vector<float> scales(P * bs, 0.0f), x(K, 0.0f), y(P * kBlock);
  const BlocksFn fns[2] = {block_kernels_for<kQ4>(Isa::Avx512).fn[1], block_kernels_for<kQ4>(Isa::Avx2).fn[1]};
  double best[2] = {1e30, 1e30};
  for (int t = 0; t < kTrials; ++t)
    for (int arm = 0; arm < 2; ++arm) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t p = 0; p < P; ++p)
        fns[arm](x.data(), K, codes.data() + p * K * cb, scales.data() + p * bs, K, y.data() + p * kBlock,
                 P * kBlock, kBlock);
      best[arm] = std::min(best[arm], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  return best[1] < kMargin * best[0] ? Isa::Avx2 : Isa::Avx512;
}

template <bool kQ4>
Isa block_isa(int64_t rows) {
  const Isa isa = active_isa();
  if (isa != Isa::Avx512 || rows > kOnePassRows) return isa;
  static const Isa chosen = [] {
    const char* env = std::getenv("HETEROSPEC_SMALL_ROWS_ISA");
    const std::string fixed = env == nullptr ? "" : env;
    if (fixed == "avx2" || fixed == "avx512") return fixed == "avx2" ? Isa::Avx2 : Isa::Avx512;
    return measured_one_row_isa<kQ4>();
  }();
  return chosen;
}

constexpr int kMaxRows = 12;  // the largest MR_MAX (AVX-512: 12, AVX2: 6, portable: 4; below)

template <typename W>
struct Kernels {
  MicroFn<W> fn[kMaxRows + 1];
  int mr_max;
};

template <typename W, template <typename, int> class Wrap>
Kernels<W> make_kernels(int mr_max) {
  return {{nullptr, Wrap<W, 1>::fn, Wrap<W, 2>::fn, Wrap<W, 3>::fn, Wrap<W, 4>::fn, Wrap<W, 5>::fn, Wrap<W, 6>::fn,
           Wrap<W, 7>::fn, Wrap<W, 8>::fn, Wrap<W, 9>::fn, Wrap<W, 10>::fn, Wrap<W, 11>::fn, Wrap<W, 12>::fn},
          mr_max};
}

template <typename W, int MR>
struct ScalarK {
  static constexpr MicroFn<W> fn = micro_scalar<W, MR>;
};
#ifdef HS_HAVE_X86_SIMD
template <typename W, int MR>
struct Avx512K {
  static constexpr MicroFn<W> fn = micro_avx512<W, MR>;
};
template <typename W, int MR>
struct Avx2K {   // one pass over the block where its accumulators fit, else halves
  static constexpr MicroFn<W> fn = MR <= kOnePassRows ? micro_avx2_one_pass<W, (MR <= kOnePassRows ? MR : 1)>
                                                      : micro_avx2<W, MR>;
};
#endif

template <typename W>
const Kernels<W>& kernels_for(Isa isa) {
  static const Kernels<W> scalar = make_kernels<W, ScalarK>(4);
#ifdef HS_HAVE_X86_SIMD
  static const Kernels<W> avx512 = make_kernels<W, Avx512K>(12);
  static const Kernels<W> avx2 = make_kernels<W, Avx2K>(6);
  if (isa == Isa::Avx512) return avx512;
  if (isa == Isa::Avx2) return avx2;
#endif
  (void)isa;
  return scalar;
}

// y [M, N] float32 = x [M, K] float32 times the packed blocks of W (phases 1-3 but the bias).
template <typename W>
void stream_rows(const float* xp, int64_t M, int64_t K, const W* pp, int64_t P, int64_t N, float* yp) {
  const Kernels<W>& ks = kernels_for<W>(active_isa());
  // Threads split the blocks evenly (each streams its share once). A task below ~64K weights
  // (256 KiB of float32) costs less than waking a second thread, so small shapes stay on one.
  const int64_t min_blocks = grain_for(K * kBlock, kGrainWork / 16);
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), P / min_blocks));
  const int64_t grain = (P + tasks - 1) / tasks;
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const W* blk = pp + p * K * kBlock;
      const int64_t valid = std::min<int64_t>(kBlock, N - p * kBlock);
      for (int64_t m0 = 0; m0 < M;) {
        const int64_t mr = chunk_rows(M - m0, ks.mr_max);
        ks.fn[mr](xp + m0 * K, K, blk, K, yp + m0 * N + p * kBlock, N, valid);
        m0 += mr;
      }
    }
  });
}

// y [M, N] = x [M, K] times the block-coded weights (phases 1-3 of stream_rows, with codes).
// kBf16: the weights rounded to bfloat16 (the small-row instruction set as the float32 kernels').
template <bool kQ4, bool kBf16>
void stream_blocks_rows(const float* xp, int64_t M, int64_t K, const uint8_t* codes, const float* scales, int64_t P,
                        int64_t N, float* yp) {
  const Isa isa = block_isa<kQ4>(M);
  const BlockKernels& ks = block_kernels_for<kQ4, kBf16>(isa);
  const int64_t block_codes = K * code_bytes<kQ4>(), block_scales = (K / kGroup) * 2 * kBlock;
#ifdef HS_HAVE_X86_SIMD
  // (up to one chunk of rows the codes are widened once anyway, in registers, with no buffer)
  const bool widened = isa != Isa::Scalar && M > ks.mr_max;
  const WidenedKernels& wk = widened_kernels<kQ4, kBf16>(isa);
#else
  const bool widened = false;
#endif
  // As stream_rows, by weights per task (a code stands for one weight's work).
  const int64_t min_blocks = grain_for(K * kBlock, kGrainWork / 16);
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), P / min_blocks));
  const int64_t grain = (P + tasks - 1) / tasks;
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t valid = std::min<int64_t>(kBlock, N - p * kBlock);
#ifdef HS_HAVE_X86_SIMD
      if (widened) {
        for (int64_t m0 = 0; m0 < M; m0 += kWidenRows)
          blocks_widened(wk, xp + m0 * K, K, std::min(kWidenRows, M - m0), codes + p * block_codes,
                         code_bytes<kQ4>(), scales + p * block_scales, K, yp + m0 * N + p * kBlock, N, valid);
        continue;
      }
#endif
      for (int64_t m0 = 0; m0 < M;) {
        const int64_t mr = chunk_rows(M - m0, ks.mr_max);
        ks.fn[mr](xp + m0 * K, K, codes + p * block_codes, scales + p * block_scales, K, yp + m0 * N + p * kBlock,
                  N, valid);
        m0 += mr;
      }
    }
  });
}

// y [..., N] of x's dtype for x [..., K]; *M = the rows (the product of x's leading sizes).
Tensor empty_rows(const Tensor& x, int64_t N, int64_t* M) {
  *M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) *M *= x.size(d);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return at::empty(shape, x.options());
}

// A bfloat16 call: x widened into a float32 buffer, y [M, N] summed in float32 by `rows` (x, M,
// y), the bias added in float32, then rounded to bfloat16 once (nearest even, as ATen's cast).
// Plain loops, not ATen ops: three dispatched ops per call (cast x, allocate y, cast y), a few
// hundred a bfloat16 step of the built-in target (bench/RESULTS.md, seventy-third session).
template <typename Rows>
Tensor bf16_rows(const Tensor& x_in, int64_t K, int64_t N, const std::optional<Tensor>& bias, Rows rows) {
  const Tensor x = x_in.contiguous();
  int64_t M = 0;
  Tensor y = empty_rows(x, N, &M);
  if (M == 0 || N == 0) return y;
  std::vector<float> xf(static_cast<size_t>(M * K)), yf(static_cast<size_t>(M * N), 0.0f);
  const at::BFloat16* xs = x.const_data_ptr<at::BFloat16>();
  constexpr int64_t kGrain = 1 << 15;     // elements a thread converts at least (a prefill's rows)
  at::parallel_for(0, M * K, kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) xf[i] = static_cast<float>(xs[i]);
  });
  if (K > 0) rows(xf.data(), M, yf.data());
  Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->contiguous();
  const at::BFloat16* bs = b.defined() ? b.const_data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* ys = y.mutable_data_ptr<at::BFloat16>();
  at::parallel_for(0, M, std::max<int64_t>(1, kGrain / N), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const float v = bs ? yf[m * N + n] + static_cast<float>(bs[n]) : yf[m * N + n];
        ys[m * N + n] = at::BFloat16(v);
      }
  });
  return y;
}

}  // namespace

// weight [N, K] float32 or bfloat16 -> packed [ceil(N / 32), K, 32] of the same dtype (layout above).
Tensor stream_linear_pack_cpu(const Tensor& weight_in) {
  constexpr const char* op = "stream_linear_pack";
  check_stream_linear_weight(op, weight_in);
  const Tensor weight = weight_in.contiguous();
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kBlock - 1) / kBlock;
  Tensor packed = at::zeros({P, K, kBlock}, weight.options());
  const int64_t elem = weight.element_size();
  const char* src = static_cast<const char*>(weight.const_data_ptr());
  char* dst = static_cast<char*>(packed.mutable_data_ptr());
  at::parallel_for(0, P, grain_for(K * kBlock), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kBlock && p * kBlock + j < N; ++j) {
        const char* row = src + (p * kBlock + j) * K * elem;
        char* col = dst + (p * K * kBlock + j) * elem;
        for (int64_t k = 0; k < K; ++k) std::memcpy(col + k * kBlock * elem, row + k * elem, elem);
      }
  });
  return packed;
}

// x [..., K], packed [P, K, 32] from stream_linear_pack, bias [N] or none, all float32 or all
// bfloat16, 32 (P - 1) < out_features = N <= 32 P -> [..., N] of x's dtype = x @ weight.T + bias
// (bfloat16: accumulated in float32 with the bias, rounded once).
Tensor stream_linear_cpu(const Tensor& x_in, const Tensor& packed_in, const std::optional<Tensor>& bias,
                         int64_t out_features) {
  constexpr const char* op = "stream_linear";
  check_stream_linear_inputs(op, x_in, packed_in, bias, out_features, kBlock);
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  const bool f16_weight = packed_in.scalar_type() == at::kHalf;   // float32 x, float16 weights
  const Tensor packed = packed_in.contiguous();
  if (bf16) {
    const int64_t P = packed.size(0), K = packed.size(1);
    const auto* w = reinterpret_cast<const uint16_t*>(packed.const_data_ptr<at::BFloat16>());
    return bf16_rows(x_in, K, out_features, bias, [&](const float* xf, int64_t M, float* yf) {
      stream_rows<uint16_t>(xf, M, K, w, P, out_features, yf);
    });
  }
  const Tensor x = x_in.contiguous();
  const int64_t P = packed.size(0), K = packed.size(1), N = out_features;
  int64_t M = 0;
  Tensor y = empty_rows(x, N, &M);                    // float32
  if (M > 0 && N > 0) {
    if (K == 0) {
      y.zero_();
    } else if (f16_weight) {
      stream_rows<F16Bits>(x.const_data_ptr<float>(), M, K,
                           reinterpret_cast<const F16Bits*>(packed.const_data_ptr<at::Half>()), P, N,
                           y.mutable_data_ptr<float>());
    } else {
      stream_rows<float>(x.const_data_ptr<float>(), M, K, packed.const_data_ptr<float>(), P, N,
                         y.mutable_data_ptr<float>());
    }
  }
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// x [..., K] float32 or bfloat16, codes [P, K, 16] uint8 (Q4_1) or [P, K, 32] int8 (Q8_0), scales
// [P, K / 32, 2, 32] float32, bias [N] of x's dtype or none -> [..., N] of x's dtype (layout at the
// top; bfloat16: the weights rounded to bfloat16, accumulated in float32 with the bias, rounded once).
Tensor stream_linear_blocks_cpu(const Tensor& x_in, const Tensor& codes_in, const Tensor& scales_in,
                                const std::optional<Tensor>& bias, int64_t out_features) {
  constexpr const char* op = "stream_linear_blocks";
  check_stream_linear_blocks_inputs(op, x_in, codes_in, scales_in, bias, out_features, kBlock, kGroup);
  const bool q4 = codes_in.scalar_type() == at::kByte;
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  const Tensor codes = codes_in.contiguous(), scales = scales_in.contiguous();
  const int64_t P = codes.size(0), K = codes.size(1), N = out_features;
  const auto* c = static_cast<const uint8_t*>(codes.const_data_ptr());
  if (bf16) {
    const auto run = q4 ? stream_blocks_rows<true, true> : stream_blocks_rows<false, true>;
    return bf16_rows(x_in, K, N, bias, [&](const float* xf, int64_t M, float* yf) {
      run(xf, M, K, c, scales.const_data_ptr<float>(), P, N, yf);
    });
  }
  const Tensor x = x_in.contiguous();
  int64_t M = 0;
  Tensor y = empty_rows(x, N, &M);
  if (M > 0 && N > 0) {
    if (K == 0) {
      y.zero_();
    } else {
      const auto run = q4 ? stream_blocks_rows<true, false> : stream_blocks_rows<false, false>;
      run(x.const_data_ptr<float>(), M, K, c, scales.const_data_ptr<float>(), P, N, y.mutable_data_ptr<float>());
    }
  }
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

TORCH_LIBRARY_IMPL(heterospec, CPU, m) {
  m.impl("stream_linear_blocks", &stream_linear_blocks_cpu);
  m.impl("stream_linear_pack", &stream_linear_pack_cpu);
  m.impl("stream_linear", &stream_linear_cpu);
}

}  // namespace heterospec
