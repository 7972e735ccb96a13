// CPU kernel: sample_tokens (the target's keyed draw). Contract: docs/design.md, op 17.
//
// Why this exists. A sampled step draws each row's token from softmax(logits / T), cut to the
// top-k tokens and the top-p nucleus, by inverse CDF with the row's keyed uniform
// (heterospec/sampling.py: processed_probs, then sample_rows). Composed from torch ops that is a
// float64 cumulative sum over the whole vocabulary, a top-k, several masks and divides, paid once
// per sampled plain step and, in a sampled speculative round, once per verified tree node (timings:
// bench/RESULTS.md, eightieth session). Here a row is two vector passes, a sort of the few nucleus
// candidates and a scan that stops at the drawn token.
//
// Layout. logits [..., V] float32 or bfloat16 (made contiguous, read as R rows of V); uniforms
// [...] float64 in [0, 1), one per row -> tokens [...] int64, ok [...] bool.
//
// Phases, per row (scratch: one float buffer of V and the block sums, per thread):
//   1. validity and maximum m. A row with a NaN or +inf, or only -inf, is not a distribution:
//      ok = false, token 0 (the composed path's total is NaN there).
//   2. x = (l - m) / T in float32, as processed_probs. With 0 < top_k < V, the k-th largest x
//      (a min-heap of k, or nth_element for large k); smaller x drop, ties with it stay.
//   3. e = exp(x) (0 where dropped, and below exp(-87.3), float32's normal range), S = sum of e in
//      float64, kept per block of kBlock entries.
//   4. top_p < 1, the nucleus: the tokens ranked by p = e / S (ties by lower id) whose running mass
//      before them (a float64 sum rounded to float32, as torch.cumsum on the CPU) is below top_p.
//      Only candidates are ranked: the tokens with p >= theta for theta = 1e-4, then 1e-7, then
//      every token with mass; a tier is complete when its candidates' mass reaches top_p (every
//      token outside it would have that much before it, so is dropped).
//   5. inverse CDF: the first token (by id) whose running mass exceeds u * total; rounding that
//      leaves u * total at or past the end picks the last token with mass. Nucleus: over the kept
//      tokens in id order. Else: block sums find the block, then its entries in turn.
// Against the composed path (tests/test_sample_op.py): the same token except where u * total
// falls within rounding (~1e-7 relative) of a boundary between two tokens, or a token's mass
// before it within rounding of top_p.
// Rows are independent; many rows split over threads (parallel.h grain).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <queue>
#include <utility>
#include <vector>

#include "cpu/isa.h"
#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "op_checks.h"
#include "ops.h"

namespace heterospec {
namespace {

constexpr int64_t kBlock = 64;               // entries per block sum (phase 3 / 5)
constexpr float kExpFloor = -87.3f;          // exp below this is 0 here (float32's normal range ends)
constexpr double kTiers[] = {1e-4, 1e-7};    // nucleus candidate thresholds on p, then all tokens
constexpr int64_t kHeapTopK = 1024;          // top-k by a min-heap up to this k, nth_element above

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

struct Params {
  float temperature;
  int64_t top_k;
  float top_p;
};

struct Scratch {
  std::vector<float> e;                            // x, then e (phase 2-3)
  std::vector<double> block;                       // block sums of e
  std::vector<std::pair<float, int64_t>> cand;     // nucleus candidates (p, id)
  std::vector<std::pair<int64_t, float>> kept;     // kept tokens (id, p)
  std::vector<float> copy;                         // nth_element's copy (large top-k)
};

#ifdef HS_HAVE_X86_SIMD
// The vector part of phase 1: the maximum over the full vectors (from 0 to the returned index),
// `bad` set for a NaN among them.
template <typename T>
__attribute__((target("avx2,fma"))) int64_t row_max_avx2(const T* row, int64_t V, float& mx, bool& bad) {
  __m256 m0 = _mm256_set1_ps(mx), unord = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 a = load8(row + i);
    unord = _mm256_or_ps(unord, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    m0 = _mm256_max_ps(m0, a);
  }
  mx = hmax_avx2(m0);
  bad = _mm256_movemask_ps(unord) != 0;
  return i;
}

template <typename T>
__attribute__((target("avx2,fma"))) int64_t scale_avx2(const T* row, int64_t V, float m, float temperature, float* x) {
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(temperature);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) _mm256_storeu_ps(x + i, _mm256_div_ps(_mm256_sub_ps(load8(row + i), vm), vt));
  return i;
}

// The vector part of phase 3: whole blocks (their count returned).
__attribute__((target("avx2,fma"))) int64_t exp_blocks_avx2(float* e, int64_t V, float lo, double* block) {
  const __m256 vlo = _mm256_set1_ps(lo);
  int64_t k = 0;
  for (; (k + 1) * kBlock <= V; ++k) {
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    for (int64_t i = k * kBlock; i < (k + 1) * kBlock; i += 8) {
      const __m256 x = _mm256_loadu_ps(e + i);
      const __m256 y = _mm256_and_ps(exp_avx2(x), _mm256_cmp_ps(x, vlo, _CMP_GE_OQ));
      _mm256_storeu_ps(e + i, y);
      acc0 = _mm256_add_pd(acc0, _mm256_cvtps_pd(_mm256_castps256_ps128(y)));
      acc1 = _mm256_add_pd(acc1, _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1)));
    }
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(acc0, acc1));
    block[k] = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
  return k;
}
#endif  // HS_HAVE_X86_SIMD

// Phase 1: the row's maximum; false when it holds a NaN or +inf or only -inf.
template <typename T>
bool row_max(const T* row, int64_t V, float& m, Isa isa) {
  float mx = -std::numeric_limits<float>::infinity();
  bool bad = false;
  int64_t j = 0;
#ifdef HS_HAVE_X86_SIMD
  if (isa >= Isa::Avx2) j = row_max_avx2(row, V, mx, bad);
#endif
  for (; j < V; ++j) {
    const float x = to_float(row[j]);
    bad |= std::isnan(x);
    mx = x > mx ? x : mx;
  }
  m = mx;
  return !bad && std::isfinite(mx);
}

// Phase 2: x = (l - m) / T into e; returns the top-k cut (x below it drops), -inf without top-k.
template <typename T>
float scale_and_cut(const T* row, int64_t V, float m, const Params& p, Scratch& s, Isa isa) {
  float* x = s.e.data();
  int64_t j = 0;
#ifdef HS_HAVE_X86_SIMD
  if (isa >= Isa::Avx2) j = scale_avx2(row, V, m, p.temperature, x);
#endif
  for (; j < V; ++j) x[j] = (to_float(row[j]) - m) / p.temperature;
  if (p.top_k <= 0 || p.top_k >= V) return -std::numeric_limits<float>::infinity();
  if (p.top_k <= kHeapTopK) {
    std::priority_queue<float, std::vector<float>, std::greater<float>> heap(x, x + p.top_k);
    for (int64_t i = p.top_k; i < V; ++i)
      if (x[i] > heap.top()) {
        heap.pop();
        heap.push(x[i]);
      }
    return heap.top();
  }
  s.copy.assign(x, x + V);
  std::nth_element(s.copy.begin(), s.copy.begin() + (p.top_k - 1), s.copy.end(), std::greater<float>());
  return s.copy[p.top_k - 1];
}

// Phase 3: e = exp(x) in place (0 below `cut` or kExpFloor); the block sums; returns S.
double exp_and_sum(int64_t V, float cut, Scratch& s, Isa isa) {
  float* e = s.e.data();
  const float lo = std::max(cut, kExpFloor);
  const int64_t nb = (V + kBlock - 1) / kBlock;
  double* block = s.block.data();
  int64_t b = 0;
#ifdef HS_HAVE_X86_SIMD
  if (isa >= Isa::Avx2) b = exp_blocks_avx2(e, V, lo, block);
#endif
  for (; b < nb; ++b) {
    double acc = 0.0;
    for (int64_t i = b * kBlock; i < std::min(V, (b + 1) * kBlock); ++i) {
      e[i] = e[i] >= lo ? std::exp(e[i]) : 0.f;
      acc += e[i];
    }
    block[b] = acc;
  }
  double S = 0.0;
  for (int64_t k = 0; k < nb; ++k) S += block[k];
  return S;
}

// Phase 4: the nucleus into s.kept as (id, p), in id order.
void nucleus(int64_t V, double S, float top_p, Scratch& s) {
  const float* e = s.e.data();
  const float inv = static_cast<float>(1.0 / S);
  auto by_rank = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  for (int tier = 0; tier <= 2; ++tier) {
    s.cand.clear();
    const float floor_e = tier < 2 ? static_cast<float>(kTiers[tier] * S) : 0.f;
    for (int64_t i = 0; i < V; ++i)
      if (e[i] > 0.f && e[i] >= floor_e) s.cand.emplace_back(e[i] * inv, i);
    std::sort(s.cand.begin(), s.cand.end(), by_rank);
    s.kept.clear();
    double cum = 0.0;
    for (const auto& [pi, id] : s.cand) {
      cum += pi;
      const float before = static_cast<float>(cum) - pi;
      if (before < top_p) s.kept.emplace_back(id, pi);
    }
    // Complete: a token outside the candidates has at least their mass before it.
    if (tier == 2 || static_cast<float>(cum) >= top_p) break;
  }
  std::sort(s.kept.begin(), s.kept.end());
}

// Phase 5 over the nucleus: the first kept token whose running mass exceeds u * (its total).
int64_t draw_kept(const Scratch& s, double u) {
  double total = 0.0;
  for (const auto& [id, pi] : s.kept) total += pi;
  const double target = u * total;
  double cum = 0.0;
  int64_t last = s.kept.front().first;
  for (const auto& [id, pi] : s.kept) {
    cum += pi;
    if (pi > 0.f) last = id;
    if (cum > target) return id;
  }
  return last;
}

// Phase 5 over the whole row: the block, then the entry within it.
int64_t draw_all(int64_t V, double S, double u, const Scratch& s) {
  const float* e = s.e.data();
  const int64_t nb = (V + kBlock - 1) / kBlock;
  const double target = u * S;
  double cum = 0.0;
  for (int64_t k = 0; k < nb; ++k) {
    if (cum + s.block[k] <= target) {
      cum += s.block[k];
      continue;
    }
    int64_t last = -1;
    for (int64_t i = k * kBlock; i < std::min(V, (k + 1) * kBlock); ++i) {
      cum += e[i];
      if (e[i] > 0.f) last = i;
      if (cum > target) return i;
    }
    if (last >= 0) return last;   // rounding: the block's sum crossed, its entries did not
  }
  for (int64_t i = V - 1; i > 0; --i)
    if (e[i] > 0.f) return i;
  return 0;
}

template <typename T>
void sample_rows(const T* x, const double* u, int64_t R, int64_t V, const Params& p, int64_t* tokens, bool* ok) {
  const Isa isa = active_isa();
  at::parallel_for(0, R, grain_for(4 * V), [&](int64_t r0, int64_t r1) {
    thread_local Scratch s;
    s.e.resize(V);
    s.block.resize((V + kBlock - 1) / kBlock);
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x + r * V;
      float m;
      ok[r] = row_max(row, V, m, isa);                                  // 1
      if (!ok[r]) {
        tokens[r] = 0;
        continue;
      }
      const float cut = scale_and_cut(row, V, m, p, s, isa);             // 2
      const double S = exp_and_sum(V, cut, s, isa);                      // 3
      if (p.top_p < 1.f) {
        nucleus(V, S, p.top_p, s);                                       // 4
        tokens[r] = draw_kept(s, u[r]);                                  // 5
      } else {
        tokens[r] = draw_all(V, S, u[r], s);                             // 5
      }
    }
  });
}

}  // namespace

std::tuple<Tensor, Tensor> sample_tokens_cpu(const Tensor& logits, const Tensor& uniforms, double temperature,
                                             int64_t top_k, double top_p) {
  constexpr const char* op = "sample_tokens";
  const int64_t V = check_cpu_logit_rows(op, logits);
  check_cpu(op, "uniforms", uniforms);
  check_dtype(op, "uniforms", uniforms, at::kDouble);
  HS_CHECK(uniforms.sizes() == logits.sizes().slice(0, logits.dim() - 1), op,
           ": expected uniforms of shape logits.shape[:-1] = ", logits.sizes().slice(0, logits.dim() - 1), ", got ",
           uniforms.sizes());
  HS_CHECK(std::isfinite(temperature) && temperature > 0.0, op,
           ": expected a finite temperature > 0 (temperature 0 is greedy: use greedy_tokens), got ", temperature);
  HS_CHECK(top_k >= 0, op, ": expected top_k >= 0 (0: no top-k), got ", top_k);
  HS_CHECK(top_p > 0.0 && top_p <= 1.0, op, ": expected 0 < top_p <= 1, got ", top_p);
  const Tensor x = logits.contiguous(), u = uniforms.contiguous();
  const int64_t R = x.numel() / V;
  const double* ud = u.const_data_ptr<double>();
  for (int64_t r = 0; r < R; ++r)
    HS_CHECK(ud[r] >= 0.0 && ud[r] < 1.0, op, ": expected uniforms in [0, 1), got ", ud[r], " at row ", r);
  Tensor tokens = at::empty(uniforms.sizes(), logits.options().dtype(at::kLong));
  Tensor ok = at::empty(uniforms.sizes(), logits.options().dtype(at::kBool));
  if (R == 0) return {tokens, ok};
  const Params p{static_cast<float>(temperature), top_k, static_cast<float>(top_p)};
  int64_t* t = tokens.mutable_data_ptr<int64_t>();
  bool* o = ok.mutable_data_ptr<bool>();
  if (x.scalar_type() == at::kFloat)
    sample_rows(x.const_data_ptr<float>(), ud, R, V, p, t, o);
  else
    sample_rows(x.const_data_ptr<c10::BFloat16>(), ud, R, V, p, t, o);
  return {tokens, ok};
}

TORCH_LIBRARY_IMPL(heterospec, CPU, m) { m.impl("sample_tokens", &sample_tokens_cpu); }

}  // namespace heterospec
