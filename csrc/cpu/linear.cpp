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
// Phases (stream_linear). x [M, K] -> y [M, N]:
//   1. split the P blocks evenly over the threads (each task streams its own blocks);
//   2. per block, the M rows in balanced chunks of <= MR_MAX (12 AVX-512, 6 AVX2, 4 portable):
//      the micro-kernel keeps rows x kBlock accumulators in registers and walks k once,
//      prefetching the block ahead (later chunks re-read the block from L2);
//   3. masked store of the block's outputs (the last block may be partial); bias added after.
//
// Row invariance. Every output y[m, n] is one chain of fused multiply-adds over k = 0..K-1 in
// order, starting from 0, whatever M, the chunking, the thread count or the instruction set
// (AVX-512, AVX2 and the portable loop compute the same chain). So a row's result does not depend
// on the rows beside it: a tree verified in one call gets, bit for bit, the outputs a one-token
// decode step would give its tokens (given the same inputs).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/isa.h"
#include "cpu/parallel.h"
#include "op_checks.h"
#include "ops.h"

namespace heterospec {
namespace {

constexpr int64_t kBlock = 32;      // outputs per packed block (two AVX-512 / four AVX2 vectors)
constexpr int64_t kPrefetch = 16;   // k steps ahead the micro-kernel prefetches (2 KiB of a block)

// ---- micro-kernels -----------------------------------------------------------------------------
// One call: MR rows of x (row stride ldx) times one packed block (K x kBlock) of weights of type W
// (float, or bfloat16 held as uint16_t) -> y's columns n0 .. n0 + kBlock - 1 (stride ldy), only
// the first `valid` of them stored. x and y are float32 (a bfloat16 call converts x exactly before
// and rounds y once after); a bfloat16 weight widens exactly to float32 (its bits shifted left by
// 16), so both weight types run the same FMA chain over float32 values.
template <typename W>
using MicroFn = void (*)(const float* x, int64_t ldx, const W* blk, int64_t K, float* y, int64_t ldy, int64_t valid);

inline float widen(float w) { return w; }
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
// 8 weights as one AVX2 vector of float32.
__attribute__((target("avx2"), always_inline)) inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
__attribute__((target("avx2"), always_inline)) inline __m256 load8(const uint16_t* w) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
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
    const __m512 w0 = load16(w), w1 = load16(w + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 b = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(b, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(b, w1, acc[m][1]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t left = valid - 16 * h;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * ldy + 16 * h, mask, acc[m][h]);
  }
}

// AVX2: 16 registers, so half a block (2 vectors of 8) at a time: MR rows x 2 (<= 12
// accumulators). The second half re-reads the block's other cache lines from L2.
template <typename W, int MR>
__attribute__((target("avx2,fma"))) void micro_avx2(const float* x, int64_t ldx, const W* blk, int64_t K,
                                                    float* y, int64_t ldy, int64_t valid) {
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const W* wh = blk + 16 * h;
    for (int64_t k = 0; k < K; ++k) {
      const W* w = wh + k * kBlock;
      if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch * kBlock), _MM_HINT_T0);
      if (h == 0 && sizeof(W) == 4) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch * kBlock + 16), _MM_HINT_T0);
      const __m256 w0 = load8(w), w1 = load8(w + 8);
      for (int m = 0; m < MR; ++m) {
        const __m256 b = _mm256_broadcast_ss(x + m * ldx + k);
        acc[m][0] = _mm256_fmadd_ps(b, w0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(b, w1, acc[m][1]);
      }
    }
    const int64_t left = std::min<int64_t>(valid - 16 * h, 16);
    if (left <= 0) break;
    for (int m = 0; m < MR; ++m) {
      float* out = y + m * ldy + 16 * h;
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
}
#endif  // HS_HAVE_X86_SIMD

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
struct Avx2K {
  static constexpr MicroFn<W> fn = micro_avx2<W, MR>;
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
        const int64_t chunks = (M - m0 + ks.mr_max - 1) / ks.mr_max;
        const int64_t mr = (M - m0 + chunks - 1) / chunks;    // balanced chunks of <= mr_max rows
        ks.fn[mr](xp + m0 * K, K, blk, K, yp + m0 * N + p * kBlock, N, valid);
        m0 += mr;
      }
    }
  });
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
  const Tensor x = bf16 ? x_in.to(at::kFloat).contiguous() : x_in.contiguous();
  const Tensor packed = packed_in.contiguous();
  const int64_t P = packed.size(0), K = packed.size(1), N = out_features;
  int64_t M = 1;                                      // rows: the product of x's leading sizes
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  Tensor y = at::empty(shape, x.options());           // float32
  if (M > 0 && N > 0) {
    if (K == 0) {
      y.zero_();
    } else if (bf16) {
      stream_rows<uint16_t>(x.const_data_ptr<float>(), M, K,
                            reinterpret_cast<const uint16_t*>(packed.const_data_ptr<at::BFloat16>()), P, N,
                            y.mutable_data_ptr<float>());
    } else {
      stream_rows<float>(x.const_data_ptr<float>(), M, K, packed.const_data_ptr<float>(), P, N,
                         y.mutable_data_ptr<float>());
    }
  }
  if (bias.has_value() && bias->defined()) y.add_(bf16 ? bias->to(at::kFloat) : *bias);
  return bf16 ? y.to(at::kBFloat16) : y;
}

TORCH_LIBRARY_IMPL(heterospec, CPU, m) {
  m.impl("stream_linear_pack", &stream_linear_pack_cpu);
  m.impl("stream_linear", &stream_linear_cpu);
}

}  // namespace heterospec
