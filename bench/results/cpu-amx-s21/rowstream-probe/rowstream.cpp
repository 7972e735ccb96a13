#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>


// out[M,N] = x[M,K] . W[N,K]^T ; streams each W row once for all M rows.
template <int MR>
__attribute__((target("avx512f"), always_inline)) static inline void tile512(
    const float* x, const float* w0, const float* w1, float* out, int64_t K, int64_t N, int64_t n, bool two) {
  const int64_t kfull = K / 16 * 16;
  const __mmask16 tail = (__mmask16)((1u << (K - kfull)) - 1u);
  __m512 a0[MR], a1[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) { a0[i] = _mm512_setzero_ps(); a1[i] = _mm512_setzero_ps(); }
  for (int64_t k = 0; k < kfull; k += 16) {
    __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w1 + k);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      __m512 xv = _mm512_loadu_ps(x + i * K + k);
      a0[i] = _mm512_fmadd_ps(v0, xv, a0[i]);
      a1[i] = _mm512_fmadd_ps(v1, xv, a1[i]);
    }
  }
  if (tail) {
    __m512 v0 = _mm512_maskz_loadu_ps(tail, w0 + kfull), v1 = _mm512_maskz_loadu_ps(tail, w1 + kfull);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      __m512 xv = _mm512_maskz_loadu_ps(tail, x + i * K + kfull);
      a0[i] = _mm512_fmadd_ps(v0, xv, a0[i]);
      a1[i] = _mm512_fmadd_ps(v1, xv, a1[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    out[i * N + n] = _mm512_reduce_add_ps(a0[i]);
    if (two) out[i * N + n + 1] = _mm512_reduce_add_ps(a1[i]);
  }
}

__attribute__((target("avx512f")))
static void block512(const float* x, const float* w, float* out, int64_t M, int64_t K, int64_t N,
                     int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += 2) {
    const bool two = n + 1 < n1;
    const float* w0 = w + n * K;
    const float* w1 = two ? w0 + K : w0;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const float* xm = x + m0 * K; float* om = out + m0 * N;
      switch (std::min<int64_t>(8, M - m0)) {
        case 1: tile512<1>(xm, w0, w1, om, K, N, n, two); break;
        case 2: tile512<2>(xm, w0, w1, om, K, N, n, two); break;
        case 3: tile512<3>(xm, w0, w1, om, K, N, n, two); break;
        case 4: tile512<4>(xm, w0, w1, om, K, N, n, two); break;
        case 5: tile512<5>(xm, w0, w1, om, K, N, n, two); break;
        case 6: tile512<6>(xm, w0, w1, om, K, N, n, two); break;
        case 7: tile512<7>(xm, w0, w1, om, K, N, n, two); break;
        default: tile512<8>(xm, w0, w1, om, K, N, n, two); break;
      }
    }
  }
}

torch::Tensor rowstream(torch::Tensor x, torch::Tensor w) {
  auto M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>(); float* op = out.data_ptr<float>();
  at::parallel_for(0, (N + 1) / 2, 16, [&](int64_t b, int64_t e) {
    block512(xp, wp, op, M, K, N, 2 * b, std::min(N, 2 * e));
  });
  return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("rowstream", &rowstream); }
