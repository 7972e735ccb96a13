// CPU kernel: tree_attention. Contract: docs/design.md, op 12.
//
// Why this exists. A decode step or a tree verify attends a handful of query rows to a prefix of
// a few hundred cached keys per layer. PyTorch's CPU attention (the flash kernel behind
// scaled_dot_product_attention) is built for long query blocks: at one to eight rows its fixed
// costs (blocking buffers, a dense [T, width] bool mask built and read per call, the transposes
// around it) outweigh the arithmetic, and a GQA group's keys are read once per query head. Over the
// target's layers that was a tenth of a float32 decode step on the 2-core box
// (bench/RESULTS.md, "Tree attention as one op"). Here the mask is implicit: the caller's
// prefix length and tree mask say which slots a row sees, and only those are read.
//
// Layout. q [B, T, Hq, D]; k_cache, v_cache [B, S, Hkv, D] (the target's per-layer cache: slot s
// of request b holds position s; the tree's own K/V are already written at slots L_b + j);
// prefix_lens [B] int64 (L_b); tree_mask [B, T, C] bool (C tree columns: C = T for a verify, whose
// rows are the tree; C > T for a draft step whose T new nodes are the last of C). Query row
// (b, t, h) attends to slots s < L_b and to slots L_b + j where tree_mask[b, t, j], with KV head
// h / (Hq / Hkv).
// -> o [B, T, Hq, D] contiguous, q's dtype. float16 / bfloat16 inputs are computed in float32
// (as the models' sdpa does on the CPU) and rounded once. Their K/V rows are widened to float32
// as the phases load them (exactly: the bits a float32 copy of the cache would hold), so a step
// reads the 16-bit cache once instead of writing and reading a float32 copy of it per layer.
//
// Phases, per query row:
//   1. scores: scale * (q . k) of each visible key, in slot order (one FMA chain per key);
//   2. softmax: the maximum, exp(score - max) (a vectorised exp), their sum in a fixed order;
//   3. output: the probability-weighted sum of the visible values in slot order, times 1 / sum.
//
// Row invariance. A row's result depends only on its query and the sequence of keys and values
// it sees (their number fixes every vector split), never on the other rows of the call, the
// batch, the thread count or where in the cache its tree slots lie. So a verified tree node gets,
// bit for bit, what a one-token decode step gives the same token after the same context (the
// lossless greedy check relies on this). Results differ between instruction sets (AVX-512, AVX2,
// portable) in the last bits; a process uses one (csrc/cpu/isa.h).
//
// Kernels: AVX-512 (D = 64, 128) and AVX2 (D = 32, 64, 128) take one GQA group's rows at a time;
// any other head size or CPU runs the portable loop row by row.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu/isa.h"
#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "op_checks.h"
#include "ops.h"

namespace heterospec {
namespace {

// Reads per task before a call uses a second thread: the linear kernels' grain. A decode step's
// attention (a few hundred cached keys per layer) is bound by reading its K/V from memory, and the
// linear calls around it already keep the threads awake.
constexpr int64_t kAttnGrain = kGrainWork / 16;

// One query row's view of its keys: slots [0, prefix) then the listed tree slots.
struct Visible {
  int64_t prefix;          // L_b
  const int64_t* tree;     // absolute slots L_b + j of the visible tree columns
  int64_t ntree;
  int64_t count() const { return prefix + ntree; }
  int64_t slot(int64_t i) const { return i < prefix ? i : tree[i - prefix]; }
};

// K or V rows of one KV head: row of slot s at base + s * stride (D contiguous elements E: float,
// or the cache's c10::BFloat16 / c10::Half, widened to float as they are read).
template <class E>
struct Rows {
  const E* base;
  int64_t stride;
  const E* at(int64_t s) const { return base + s * stride; }
};

// ---- portable ----------------------------------------------------------------------------------
template <class E>
void row_scalar(const float* q, Rows<E> k, Rows<E> v, const Visible& vis, int64_t D, float scale, float* p,
                float* out) {
  const int64_t n = vis.count();
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {                         // 1. scores
    const E* kr = k.at(vis.slot(i));
    float acc = 0.f;
    for (int64_t d = 0; d < D; ++d) acc += q[d] * static_cast<float>(kr[d]);
    p[i] = acc * scale;
    mx = std::max(mx, p[i]);
  }
  float sum = 0.f;                                          // 2. softmax
  for (int64_t i = 0; i < n; ++i) {
    p[i] = std::exp(p[i] - mx);
    sum += p[i];
  }
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;             // 3. output
  for (int64_t i = 0; i < n; ++i) {
    const E* vr = v.at(vis.slot(i));
    for (int64_t d = 0; d < D; ++d) out[d] += p[i] * static_cast<float>(vr[d]);
  }
  const float inv = 1.f / sum;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

#ifdef HS_HAVE_X86_SIMD
// Sixteen vectors -> one vector whose lane j is the sum of a[j]'s lanes, keys in order:
// pairs of keys (32-bit interleave), then quads (64-bit), then 128-bit quarters twice.
__attribute__((target("avx512f,avx2,fma"))) inline __m512 sum16_avx512(const __m512 a[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_maskz_unpacklo_ps(kAll, a[2 * i], a[2 * i + 1]),
                         _mm512_maskz_unpackhi_ps(kAll, a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_maskz_unpacklo_pd(__mmask8(0xFF), x, y)),
                         _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(__mmask8(0xFF), x, y)));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 d0 = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, c[0], c[1], kEven),
                                  _mm512_maskz_shuffle_f32x4(kAll, c[0], c[1], kOdd));
  const __m512 d1 = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, c[2], c[3], kEven),
                                  _mm512_maskz_shuffle_f32x4(kAll, c[2], c[3], kOdd));
  return _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, d0, d1, kEven),
                       _mm512_maskz_shuffle_f32x4(kAll, d0, d1, kOdd));
}

// The widest head a SIMD kernel takes; a zero row of it stands in for the missing keys of a block
// (all bits zero: 0.0 as float, bfloat16 and float16 alike).
constexpr int64_t kMaxD = 128;

// Keys ahead whose K (phase 1) or V (phase 3) row a SIMD kernel asks the cache for. One KV head's
// rows are D floats every Hkv * D, slots in tree order, and a decode step finds them evicted by
// the layer's weights: without the hint a step over a long context waited on memory
// (bench/RESULTS.md, sixty-first session). A prefetch changes no result.
constexpr int64_t kPrefetchKeys = 16;

// Asks for the row of visible key idx (if there is one): `bytes` from its start.
template <class E>
inline void prefetch_row(Rows<E> r, const Visible& vis, int64_t idx, int64_t n, int64_t bytes) {
  if (idx < n) {
    const char* row = reinterpret_cast<const char*>(r.at(vis.slot(idx)));
    for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(row + c, _MM_HINT_T0);
  }
}

// ---- AVX-512 phases (group_rows below takes a GQA group's rows through them) --------------------

// Phase 1 for keys i .. min(i + 16, n) - 1 of one row: one FMA chain over D per key, then the
// sixteen partial vectors summed in one transpose-and-add tree (missing keys are zero vectors).
alignas(64) const float kZeroRow[kMaxD] = {};
template <class E>
const E* zero_row() {
  return reinterpret_cast<const E*>(kZeroRow);
}

template <int C, class E>
__attribute__((target("avx512f,avx2,fma"))) inline void scores_block_avx512(const float* q, Rows<E> k,
                                                                           const Visible& vis, int64_t i, int64_t n,
                                                                           float scale, float* p, bool hint) {
  const int64_t m = std::min<int64_t>(16, n - i);
  const E* kr[16];
  for (int64_t j = 0; j < 16; ++j) kr[j] = j < m ? k.at(vis.slot(i + j)) : zero_row<E>();
  if (hint)
    for (int64_t j = 0; j < 16; ++j) prefetch_row(k, vis, i + j + kPrefetchKeys, n, 16 * C * sizeof(E));
  __m512 qv[C], acc[16];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[j] = _mm512_fmadd_ps(qv[c], load16(kr[j] + 16 * c), acc[j]);
  }
  const __m512 sc = _mm512_mul_ps(sum16_avx512(acc), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(p + i, m == 16 ? kAll : __mmask16((1u << m) - 1), sc);
}

// Phase 2 of one row: p[0, n) -> exp(p - max) in place; returns 1 / their sum.
__attribute__((target("avx512f,avx2,fma"))) inline float softmax_avx512(float* p, int64_t n) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? kAll : __mmask16((1u << (n - j)) - 1);
    mv = _mm512_mask_max_ps(mv, m, mv, _mm512_maskz_loadu_ps(m, p + j));
  }
  const __m512 mx = _mm512_set1_ps(hmax_avx512(mv));
  __m512 sv = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? kAll : __mmask16((1u << (n - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + j), mx)));
    _mm512_mask_storeu_ps(p + j, m, e);
    sv = _mm512_add_ps(sv, e);
  }
  return 1.f / hsum_avx512(sv);
}

// Phase 3 for keys i .. min(i + 16, n) - 1 of G rows that see the same keys (G = 1: any row;
// G > 1: a block of the rows' common prefix): acc_g[0, D) += p_g[j] * v_j, in index order. Each
// V row is loaded once for the G rows, and their FMA chains interleave (one row's C chains wait
// on the FMA latency); a row's chain, and so its bits, is the one it runs alone.
template <int C, int G, class E>
__attribute__((target("avx512f,avx2,fma"))) inline void values_block_avx512(const float* const* p, Rows<E> v,
                                                                           const Visible& vis, int64_t i, int64_t n,
                                                                           float* const* acc_mem, bool hint) {
  __m512 acc[G][C];
#pragma GCC unroll 2
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_loadu_ps(acc_mem[g] + 16 * c);
  const int64_t e = std::min<int64_t>(i + 16, n);
  for (int64_t j = i; j < e; ++j) {
    const E* vr = v.at(vis.slot(j));
    if (hint) prefetch_row(v, vis, j + kPrefetchKeys, n, 16 * C * sizeof(E));
    __m512 w[G];
#pragma GCC unroll 2
    for (int g = 0; g < G; ++g) w[g] = _mm512_set1_ps(p[g][j]);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 x = load16(vr + 16 * c);
#pragma GCC unroll 2
      for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(w[g], x, acc[g][c]);
    }
  }
#pragma GCC unroll 2
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc_mem[g] + 16 * c, acc[g][c]);
}

// ---- AVX2 phases: keys in quads (one FMA chain over D per key, the four partial vectors summed
// by horizontal adds: the same tree for every key) ----------------------------------------------
// Four keys' dot products -> their four scores (the tree: pairs of lanes, pairs of pairs, halves).
__attribute__((target("avx2,fma"), always_inline)) inline __m128 quad_scores_avx2(const __m256* a, float scale) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), _mm_set1_ps(scale));
}

// Phase 1 for keys i .. min(i + 16, n) - 1 of one row. Two quads at a time: eight independent
// FMA chains keep both FMA pipes busy (one quad's four chains wait on the FMA latency); each key
// still gets its own chain over D and the quad's reduction tree, so its score's bits are those of
// a quad alone.
template <int C, class E>
__attribute__((target("avx2,fma,f16c"))) inline void scores_block_avx2(const float* q, Rows<E> k, const Visible& vis,
                                                                      int64_t i, int64_t n, float scale, float* p,
                                                                      bool hint) {
  const int64_t e = std::min<int64_t>(i + 16, n);
  for (int64_t j = i; j < e; j += 8) {
    const int64_t m = std::min<int64_t>(8, e - j);
    const E* kr[8];
    for (int64_t u = 0; u < 8; ++u) kr[u] = u < m ? k.at(vis.slot(j + u)) : zero_row<E>();
    if (hint)
      for (int64_t u = 0; u < 8; ++u) prefetch_row(k, vis, j + u + kPrefetchKeys, n, 8 * C * sizeof(E));
    __m256 a[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const __m256 qc = _mm256_loadu_ps(q + 8 * c);
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qc, load8(kr[u] + 8 * c), a[u]);
    }
    alignas(32) float eight[8];
    _mm_store_ps(eight, quad_scores_avx2(a, scale));
    _mm_store_ps(eight + 4, quad_scores_avx2(a + 4, scale));
    for (int64_t u = 0; u < m; ++u) p[j + u] = eight[u];
  }
}

// Phase 2 of one row: p[0, n) -> exp(p - max) in place (p has room for n rounded up to 8);
// returns 1 / their sum.
__attribute__((target("avx2,fma"))) inline float softmax_avx2(float* p, int64_t n) {
  const int64_t n8 = (n + 7) / 8 * 8;
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = n; j < n8; ++j) p[j] = -std::numeric_limits<float>::infinity();
  __m256 mv = ninf;
  for (int64_t j = 0; j < n8; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + j));
  const __m256 mx = _mm256_set1_ps(hmax_avx2(mv));
  __m256 sv = _mm256_setzero_ps();
  for (int64_t j = 0; j < n8; j += 8) {
    const __m256 s = _mm256_loadu_ps(p + j);
    const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(s, ninf, _CMP_EQ_OQ), exp_avx2(_mm256_sub_ps(s, mx)));
    _mm256_storeu_ps(p + j, e);
    sv = _mm256_add_ps(sv, e);
  }
  return 1.f / hsum_avx2(sv);
}

// Phase 3 as values_block_avx512 (G rows that see the same keys), 8 lanes.
template <int C, int G, class E>
__attribute__((target("avx2,fma,f16c"))) inline void values_block_avx2(const float* const* p, Rows<E> v,
                                                                      const Visible& vis, int64_t i, int64_t n,
                                                                      float* const* acc_mem, bool hint) {
  __m256 acc[G][C];
#pragma GCC unroll 2
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[g][c] = _mm256_loadu_ps(acc_mem[g] + 8 * c);
  const int64_t e = std::min<int64_t>(i + 16, n);
  for (int64_t j = i; j < e; ++j) {
    const E* vr = v.at(vis.slot(j));
    if (hint) prefetch_row(v, vis, j + kPrefetchKeys, n, 8 * C * sizeof(E));
    __m256 w[G];
#pragma GCC unroll 2
    for (int g = 0; g < G; ++g) w[g] = _mm256_set1_ps(p[g][j]);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const __m256 x = load8(vr + 8 * c);
#pragma GCC unroll 2
      for (int g = 0; g < G; ++g) acc[g][c] = _mm256_fmadd_ps(w[g], x, acc[g][c]);
    }
  }
#pragma GCC unroll 2
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc_mem[g] + 8 * c, acc[g][c]);
}

#endif  // HS_HAVE_X86_SIMD

// A GQA group's rows (one request, so one prefix): query q[r], keys vis[r], scores p[r], output
// out[r] (phase 3's accumulator). K: one instruction set's phases for K/V elements E:
//   K::scores(q, k, vis, i, n, scale, p, hint)  phase 1 for a row's keys i .. min(i + 16, n) - 1;
//   K::softmax(p, n) -> 1 / sum                 phase 2 of a row;
//   K::values<G>(p, v, vis, i, n, acc, hint)    phase 3 for the same keys of G rows that see them
//                                               all, acc_g[0, D) += p_g[j] * v_j; K::kPair: the
//                                               G it takes for a common-prefix block;
// hint: prefetch the rows of the keys ahead (only the first row of a shared block asks: the rows
// after it would ask for the same lines, and at 8-16 tree rows the repeated prefetches were as
// many instructions as the FMAs).
// Blocks of 16 keys of the common prefix are taken for every row in turn (read from L2 once,
// then from L1); the rest of each row's keys (the prefix's tail and its tree) row by row. Each
// row still runs exactly its own sequence of blocks, so the grouping changes no row's bits.
template <class K, class E>
void group_rows(const float* const* q, int64_t R, Rows<E> k, Rows<E> v, const Visible* vis, int64_t D, float scale,
                float* const* p, float* const* out) {
  const int64_t shared = vis[0].prefix / 16 * 16;   // whole blocks of the common prefix
  for (int64_t i = 0; i < shared; i += 16)                      // 1. scores
    for (int64_t r = 0; r < R; ++r) K::scores(q[r], k, vis[r], i, vis[r].count(), scale, p[r], r == 0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = shared; i < vis[r].count(); i += 16) K::scores(q[r], k, vis[r], i, vis[r].count(), scale, p[r], true);
  std::vector<float> inv(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {                             // 2. softmax
    inv[r] = K::softmax(p[r], vis[r].count());
    std::fill(out[r], out[r] + D, 0.f);
  }
  constexpr int G = K::kPair;
  for (int64_t i = 0; i < shared; i += 16) {                    // 3. output
    int64_t r = 0;
    for (; r + G <= R; r += G) K::template values<G>(p + r, v, vis[r], i, vis[r].count(), out + r, r == 0);
    for (; r < R; ++r) K::template values<1>(p + r, v, vis[r], i, vis[r].count(), out + r, r == 0);
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = shared; i < vis[r].count(); i += 16)
      K::template values<1>(p + r, v, vis[r], i, vis[r].count(), out + r, true);
    for (int64_t d = 0; d < D; ++d) out[r][d] *= inv[r];
  }
}

#ifdef HS_HAVE_X86_SIMD
template <int C, class E>
struct Avx512Phases {
  static constexpr auto scores = scores_block_avx512<C, E>;
  static constexpr auto softmax = softmax_avx512;
  template <int G>
  static constexpr auto values = values_block_avx512<C, G, E>;
  static constexpr int kPair = 2;            // 2 x C accumulators of 32 registers
};

template <int C, class E>
struct Avx2Phases {
  static constexpr auto scores = scores_block_avx2<C, E>;
  static constexpr auto softmax = softmax_avx2;
  template <int G>
  static constexpr auto values = values_block_avx2<C, G, E>;
  static constexpr int kPair = C <= 4 ? 2 : 1;   // 16 registers: C >= 8 chains are enough alone
};
#endif

template <class E>
using GroupFn = void (*)(const float* const*, int64_t, Rows<E>, Rows<E>, const Visible*, int64_t, float,
                         float* const*, float* const*);

// The portable kernel takes a group's rows one at a time.
template <class E>
void group_scalar(const float* const* q, int64_t R, Rows<E> k, Rows<E> v, const Visible* vis, int64_t D, float scale,
                  float* const* p, float* const* out) {
  for (int64_t r = 0; r < R; ++r) row_scalar(q[r], k, v, vis[r], D, scale, p[r], out[r]);
}

template <class E>
GroupFn<E> group_kernel(int64_t D) {
#ifdef HS_HAVE_X86_SIMD
  const Isa isa = active_isa();
  if (isa == Isa::Avx512 && D == 64) return group_rows<Avx512Phases<4, E>, E>;
  if (isa == Isa::Avx512 && D == 128) return group_rows<Avx512Phases<8, E>, E>;
  if (isa >= Isa::Avx2 && D == 32) return group_rows<Avx2Phases<4, E>, E>;
  if (isa >= Isa::Avx2 && D == 64) return group_rows<Avx2Phases<8, E>, E>;
  if (isa >= Isa::Avx2 && D == 128) return group_rows<Avx2Phases<16, E>, E>;
#endif
  return group_scalar<E>;
}

// t with a unit last stride (a copy only when needed).
Tensor unit_rows(const Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); }

}  // namespace

// q [B, T, Hq, D], k_cache / v_cache [B, S, Hkv, D] (q's dtype), prefix_lens [B] int64,
// tree_mask [B, T, C] bool -> o [B, T, Hq, D].
Tensor tree_attention_cpu(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& prefix_lens_in,
                          const Tensor& tree_mask_in, double scale) {
  constexpr const char* op = "tree_attention";
  check_tree_attention_inputs(Backend::CPU, op, q_in, k_in, v_in, prefix_lens_in, tree_mask_in, scale);
  const int64_t B = q_in.size(0), T = q_in.size(1), Hq = q_in.size(2), D = q_in.size(3);
  const int64_t S = k_in.size(1), Hkv = k_in.size(2), C = tree_mask_in.size(2);
  const Tensor prefix_lens = prefix_lens_in.contiguous(), tree_mask = tree_mask_in.contiguous();
  const int64_t* lp = prefix_lens.const_data_ptr<int64_t>();
  const bool* mp = tree_mask.const_data_ptr<bool>();
  int64_t width = 0;
  for (int64_t b = 0; b < B; ++b) {
    HS_CHECK(lp[b] >= 0 && lp[b] + C <= S, op, ": expected 0 <= prefix_lens[", b, "] and prefix_lens[", b,
             "] + C <= S (C = tree_mask.size(2) tree slots after the prefix, S the cache's slots), got prefix_lens[",
             b, "] = ", lp[b], ", C = ", C, ", S = ", S);
    width = std::max(width, lp[b] + C);
    for (int64_t t = 0; t < T && lp[b] == 0; ++t)
      HS_CHECK(std::any_of(mp + (b * T + t) * C, mp + (b * T + t + 1) * C, [](bool x) { return x; }), op,
               ": query row (b = ", b, ", t = ", t, ") sees no key (prefix_lens[", b,
               "] = 0 and its tree_mask row is all False)");
  }
  Tensor out = at::empty({B, T, Hq, D}, q_in.options());
  if (out.numel() == 0) return out;
  // Only the slots some row can see are read; float16 / bfloat16 K/V stay in the cache's dtype
  // (the phases widen them), q (a few rows) is widened here.
  const Tensor q = unit_rows(q_in.to(at::kFloat));
  const Tensor k = unit_rows(k_in.narrow(1, 0, width)), v = unit_rows(v_in.narrow(1, 0, width));
  const bool f32 = q_in.scalar_type() == at::kFloat;
  Tensor out32 = f32 ? out : at::empty({B, T, Hq, D}, q_in.options().dtype(at::kFloat));
  const float* qp = q.const_data_ptr<float>();
  float* op_ = out32.mutable_data_ptr<float>();
  const int64_t group = Hq / Hkv, R = T * group;   // one KV head's query rows: its query heads at every t
  const float sc = static_cast<float>(scale);
  const int64_t ps = width + 16;                 // a row's scores, room for a masked last block
  // One item per (b, g, chunk): a chunk of the R rows of request b's KV head g, each row about
  // (L_b + C) * D * 2 reads. One request has only Hkv (b, g) pairs, 3 for the built-in target:
  // on 2 threads one took two of them and the other one, so groups are cut into chunks until
  // there are about 4 per thread (a row's result does not depend on the rows beside it). A
  // smaller call keeps whole groups: a key block read once serves all their rows (a decode step
  // split by rows read each group's K/V from memory once per row, measured slower).
  const int64_t row_work = (width + 1) * D * 2;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunks = B * Hkv * R * row_work < 2 * kGrainWork
                             ? 1
                             : std::min<int64_t>(R, std::max<int64_t>(1, (4 * threads + B * Hkv - 1) / (B * Hkv)));
  const int64_t chunk_rows = (R + chunks - 1) / chunks;
  auto attend = [&](auto elem) {   // elem: a value of the K/V element type
    using E = decltype(elem);
    const E* kp = k.const_data_ptr<E>();
    const E* vp = v.const_data_ptr<E>();
    const GroupFn<E> kernel = group_kernel<E>(D);
    at::parallel_for(0, B * Hkv * chunks, grain_for(chunk_rows * row_work, kAttnGrain), [&](int64_t i0, int64_t i1) {
      std::vector<float> p(static_cast<size_t>(R * ps));
      std::vector<float*> pr(static_cast<size_t>(R));
      for (int64_t r = 0; r < R; ++r) pr[r] = p.data() + r * ps;
      std::vector<int64_t> tree(static_cast<size_t>(T * C));
      std::vector<Visible> vis(static_cast<size_t>(R));
      std::vector<const float*> qr(static_cast<size_t>(R));
      std::vector<float*> outs(static_cast<size_t>(R));
      for (int64_t it = i0; it < i1; ++it) {
        const int64_t bg = it / chunks, b = bg / Hkv, g = bg % Hkv;
        const int64_t r0 = (it % chunks) * chunk_rows, r1 = std::min(R, r0 + chunk_rows);
        if (r0 >= r1) continue;
        for (int64_t t = r0 / group; t <= (r1 - 1) / group; ++t) {
          int64_t* slots = tree.data() + t * C;
          int64_t nt = 0;
          const bool* mrow = mp + (b * T + t) * C;
          for (int64_t j = 0; j < C; ++j)
            if (mrow[j]) slots[nt++] = lp[b] + j;
          for (int64_t hh = 0; hh < group; ++hh) {
            const int64_t r = t * group + hh, h = g * group + hh;
            vis[r] = Visible{lp[b], slots, nt};
            qr[r] = qp + b * q.stride(0) + t * q.stride(1) + h * q.stride(2);
            outs[r] = op_ + ((b * T + t) * Hq + h) * D;
          }
        }
        const Rows<E> kr{kp + b * k.stride(0) + g * k.stride(2), k.stride(1)};
        const Rows<E> vr{vp + b * v.stride(0) + g * v.stride(2), v.stride(1)};
        kernel(qr.data() + r0, r1 - r0, kr, vr, vis.data() + r0, D, sc, pr.data(), outs.data() + r0);
      }
    });
  };
  switch (k.scalar_type()) {
    case at::kFloat: attend(float{}); break;
    case at::kBFloat16: attend(c10::BFloat16{}); break;
    default: attend(c10::Half{}); break;   // (check_tree_attention_inputs admits only these three)
  }
  if (!f32) out.copy_(out32);
  return out;
}

TORCH_LIBRARY_IMPL(heterospec, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }

}  // namespace heterospec
