// CPU kernels: topk_entropy, entropy_bin_policy. Contracts: docs/design.md, ops 1 and 3.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HS_HAVE_AVX2_PATH 1
#include <immintrin.h>
#endif

#include "cpu/parallel.h"
#include "op_checks.h"
#include "ops.h"

namespace heterospec {
namespace {

constexpr int64_t kMaxK = 64;
// Elements per chunk: a chunk is read from memory once, then its exp-sum is taken while it sits in
// L1 (4 KiB of float32). Memory sees exactly one pass over each row.
constexpr int64_t kChunk = 1024;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Running top-k: values sorted descending, ties in ascending id order (ids arrive ascending, so a
// new element equal to a stored one goes after it, and once full only a strictly larger value
// enters).
struct TopK {
  int64_t k = 0;
  int64_t count = 0;
  float vals[kMaxK];
  int64_t ids[kMaxK];

  // Smallest kept value once full; -inf before (callers use `full()` to accept everything).
  float threshold() const { return count == k ? vals[k - 1] : kNegInf; }
  bool full() const { return count == k; }

  void push(float x, int64_t id) {
    if (count == k && !(x > vals[k - 1])) return;
    int64_t pos = count < k ? count : k - 1;
    // Shift smaller values down; stop at the first stored value >= x (keeps ties stable).
    while (pos > 0 && vals[pos - 1] < x) {
      vals[pos] = vals[pos - 1];
      ids[pos] = ids[pos - 1];
      --pos;
    }
    vals[pos] = x;
    ids[pos] = id;
    if (count < k) ++count;
  }
};

// Row state shared by the portable and AVX2 paths: running max and sum of exp(x - max).
struct RowStats {
  float max = kNegInf;
  double sumexp = 0.0;
  bool nan = false;

  // Merge a chunk whose max is `cmax` (sum computed afterwards relative to the new max).
  void rescale_to(float new_max) {
    if (new_max > max) {
      if (max != kNegInf) sumexp *= std::exp(static_cast<double>(max) - static_cast<double>(new_max));
      max = new_max;
    }
  }
};

// ---------------- portable path ----------------
// What non-x86 CPUs run (and x86 ones without AVX2). Branch-free `omp simd` loops that the
// compiler vectorises for the baseline ISA (SSE2, NEON): std::exp per element would make the
// fused op slower than PyTorch's composite.

// exp(t) for t <= 0 with the AVX2 path's range reduction and degree-7 polynomial: t = n ln2 + r,
// n rounded by adding 1.5 * 2^23 (which also leaves n in the low mantissa bits, so 2^n needs no
// float-to-int conversion). t below -87.3 (under FLT_MIN), -inf and NaN give 0 (NaN rows are
// flagged separately). Selects, not branches: with -fno-trapping-math (setup.py, CMakeLists.txt)
// the loops calling this vectorise.
inline float exp_nonpos_portable(float t) {
  const float keep = t >= -87.3f ? 1.f : 0.f;
  t = t > -87.3f ? t : -87.3f;
  const float shifted = t * 1.44269504088896341f + 12582912.f;
  const float n = shifted - 12582912.f;
  float r = t - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits;  // std::bit_cast is C++20; torch < 2.13 builds extensions as C++17
  std::memcpy(&bits, &shifted, sizeof bits);
  bits = (bits - 0x4B400000 + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale * keep;
}

template <typename scalar_t>
void scan_row_portable(const scalar_t* row, int64_t V, TopK& top, RowStats& st) {
  float buf[kChunk];
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t n = std::min(V - c0, kChunk);
    for (int64_t j = 0; j < n; ++j) buf[j] = to_float(row[c0 + j]);
    // Pass 1: chunk max and NaN flag (a NaN never wins `x > cmax`; it is flagged instead), then
    // the top-k candidates above the running threshold.
    float cmax = kNegInf;
    int any_nan = 0;
#pragma omp simd reduction(max : cmax) reduction(| : any_nan)
    for (int64_t j = 0; j < n; ++j) {
      const float x = buf[j];
      cmax = x > cmax ? x : cmax;
      any_nan |= (x != x);
    }
    if (any_nan) st.nan = true;
    // Candidates: most blocks of a long row hold none once the top-k is full, and a vectorised
    // block max says so without a branch per element.
    constexpr int64_t kBlock = 32;
    for (int64_t b0 = 0; b0 < n && (!top.full() || cmax > top.threshold()); b0 += kBlock) {
      const int64_t b1 = std::min(n, b0 + kBlock);
      float bmax = kNegInf;
#pragma omp simd reduction(max : bmax)
      for (int64_t j = b0; j < b1; ++j) bmax = buf[j] > bmax ? buf[j] : bmax;
      if (top.full() && !(bmax > top.threshold())) continue;
      for (int64_t j = b0; j < b1; ++j)
        if (!top.full() || buf[j] > top.threshold()) top.push(buf[j], c0 + j);
    }
    st.rescale_to(cmax);
    if (st.max == kNegInf || std::isinf(st.max)) continue;  // nothing to add yet / invalid row
    // Pass 2 (chunk in L1): sum of exp(x - max); `omp simd` licenses the reassociation.
    const float m = st.max;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < n; ++j) s += exp_nonpos_portable(buf[j] - m);
    st.sumexp += s;
  }
}

#ifdef HS_HAVE_AVX2_PATH
#define HS_AVX2 __attribute__((target("avx2,fma,f16c")))

HS_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
HS_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
HS_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// exp(t) for t <= 0 (t = x - rowmax). Range reduction t = n ln2 + r, |r| <= ln2/2, then a degree-7
// Taylor polynomial (truncation error < 6e-9 relative) and 2^n by exponent bits. t below -87.3
// (result under FLT_MIN, including -inf) gives exactly 0.
HS_AVX2 inline __m256 exp_nonpos(__m256 t) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 keep = _mm256_cmp_ps(t, lo, _CMP_GE_OQ);
  t = _mm256_max_ps(t, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), t);  // ln2 split in hi + lo
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

HS_AVX2 inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

HS_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

template <typename scalar_t>
HS_AVX2 void scan_row_avx2(const scalar_t* row, int64_t V, TopK& top, RowStats& st) {
  const int64_t Vvec = V - V % 8;
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t c1 = std::min(V, c0 + kChunk);
    const int64_t c1v = std::min(c1, Vvec);
    // Pass 1 (from memory): chunk max, NaN flag, top-k candidates above the running threshold.
    __m256 vmax = _mm256_set1_ps(kNegInf);
    __m256 vnan = _mm256_setzero_ps();
    __m256 vthr = _mm256_set1_ps(top.threshold());
    int64_t j = c0;
    for (; j < c1v; j += 8) {
      const __m256 x = load8(row + j);
      vmax = _mm256_max_ps(vmax, x);
      vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      int mask = top.full() ? _mm256_movemask_ps(_mm256_cmp_ps(x, vthr, _CMP_GT_OQ)) : 0xff;
      if (mask) {
        alignas(32) float xs[8];
        _mm256_store_ps(xs, x);
        for (int l = 0; l < 8; ++l)
          if (mask & (1 << l)) top.push(xs[l], j + l);
        vthr = _mm256_set1_ps(top.threshold());
      }
    }
    float cmax = hmax8(vmax);
    for (; j < c1; ++j) {  // row tail (< 8 elements)
      const float x = to_float(row[j]);
      if (std::isnan(x)) st.nan = true;
      cmax = x > cmax ? x : cmax;
      if (!top.full() || x > top.threshold()) top.push(x, j);
    }
    if (_mm256_movemask_ps(vnan)) st.nan = true;
    st.rescale_to(cmax);
    if (st.max == kNegInf || std::isinf(st.max)) continue;
    // Pass 2 (chunk is in L1): sum of exp(x - max).
    const float m = st.max;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    j = c0;
    for (; j + 16 <= c1v; j += 16) {
      acc0 = _mm256_add_ps(acc0, exp_nonpos(_mm256_sub_ps(load8(row + j), vm)));
      acc1 = _mm256_add_ps(acc1, exp_nonpos(_mm256_sub_ps(load8(row + j + 8), vm)));
    }
    for (; j < c1v; j += 8) acc0 = _mm256_add_ps(acc0, exp_nonpos(_mm256_sub_ps(load8(row + j), vm)));
    float s = hsum8(_mm256_add_ps(acc0, acc1));
    for (; j < c1; ++j) s += std::exp(to_float(row[j]) - m);
    st.sumexp += s;
  }
}

// HETEROSPEC_CPU_SCALAR=1 forces the portable path, the one non-x86 machines run, so that the
// tests (and benchmarks) can check it on x86 too.
bool cpu_has_avx2() {
  static const bool ok = [] {
    const char* force_scalar = std::getenv("HETEROSPEC_CPU_SCALAR");
    if (force_scalar != nullptr && force_scalar[0] == '1') return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok;
}
#endif  // HS_HAVE_AVX2_PATH

// Entropy of the renormalised top-k distribution, from sorted descending top values.
double topk_entropy_of(const float* vals, int64_t k) {
  const double v0 = vals[0];
  double z = 0.0, wsum = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    if (vals[i] == kNegInf) continue;  // zero probability: 0 log 0 = 0
    const double d = static_cast<double>(vals[i]) - v0;
    const double w = std::exp(d);
    z += w;
    wsum += w * d;
  }
  // H = -sum q log q with q = w / z and log q = d - log z.
  const double h = std::log(z) - wsum / z;
  return h > 0.0 ? h : 0.0;
}

// Classifies an invalid row for the error message (only runs on the error path).
template <typename scalar_t>
const char* row_problem(const scalar_t* row, int64_t V) {
  bool nan = false, pinf = false;
  for (int64_t j = 0; j < V; ++j) {
    const float x = to_float(row[j]);
    nan |= std::isnan(x);
    pinf |= (x == std::numeric_limits<float>::infinity());
  }
  if (nan) return "contains NaN";
  if (pinf) return "contains +inf";
  return "is all -inf (no token has positive probability)";
}

template <typename scalar_t>
void topk_entropy_impl(const at::Tensor& logits, int64_t k, const float* parent, float* out_lp, int64_t* out_ids,
                       float* out_h) {
  const int64_t M = logits.size(0), V = logits.size(1), row_stride = logits.stride(0);
  const scalar_t* base = logits.const_data_ptr<scalar_t>();
  std::atomic<int64_t> bad_row{M};
  // ~256K logits per task: [64, 49152] gives 13 balanced tasks (rows are ~0.5 ns per logit).
  const int64_t grain = grain_for(V, int64_t{1} << 18);
  at::parallel_for(0, M, grain, [&](int64_t r0, int64_t r1) {
    TopK top;
    top.k = k;
    for (int64_t r = r0; r < r1; ++r) {
      const scalar_t* row = base + r * row_stride;
      top.count = 0;
      RowStats st;
#ifdef HS_HAVE_AVX2_PATH
      if (cpu_has_avx2())
        scan_row_avx2(row, V, top, st);
      else
#endif
        scan_row_portable(row, V, top, st);
      const bool ok = !st.nan && std::isfinite(st.max) && st.sumexp > 0.0 && std::isfinite(st.sumexp);
      if (!ok) {
        int64_t cur = bad_row.load();
        while (r < cur && !bad_row.compare_exchange_weak(cur, r)) {
        }
        for (int64_t i = 0; i < k; ++i) {  // the CUDA op's outputs for an invalid row (raised below)
          out_lp[r * k + i] = kNegInf;
          out_ids[r * k + i] = i;
        }
        out_h[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const double log_z = static_cast<double>(st.max) + std::log(st.sumexp);
      for (int64_t i = 0; i < k; ++i) {
        out_lp[r * k + i] = static_cast<float>(static_cast<double>(top.vals[i]) - log_z);
        out_ids[r * k + i] = top.ids[i];
      }
      const double h = topk_entropy_of(top.vals, k);
      out_h[r] = static_cast<float>((parent ? static_cast<double>(parent[r]) : 0.0) + h);
    }
  });
  const int64_t r = bad_row.load();
  HS_CHECK(r == M, "topk_entropy: row ", r, " of logits ", row_problem(base + r * row_stride, V),
           "; every row needs at least one finite logit and no NaN or +inf");
}

}  // namespace

// logits [M, V] float32/float16/bfloat16; parent_entropy [M] float32 or None.
// -> topk_logprobs [M, k] float32 (descending), topk_ids [M, k] int64, path_entropy [M] float32.
std::tuple<Tensor, Tensor, Tensor> topk_entropy_cpu(const Tensor& logits_in, int64_t k,
                                                    const std::optional<Tensor>& parent_entropy) {
  constexpr const char* op = "topk_entropy";
  check_topk_logits(Backend::CPU, op, logits_in, k, kMaxK);
  const int64_t M = logits_in.size(0), V = logits_in.size(1);
  const float* parent = nullptr;
  Tensor parent_c;
  if (parent_entropy.has_value() && parent_entropy->defined()) {
    check_parent_entropy(op, *parent_entropy, logits_in);
    parent_c = parent_entropy->contiguous();
    parent = parent_c.const_data_ptr<float>();
  }
  // Rows may be strided; the vocabulary dimension must be contiguous (else copy once).
  const Tensor logits = (logits_in.stride(1) == 1 || V <= 1) ? logits_in : logits_in.contiguous();
  auto lp = at::empty({M, k}, logits.options().dtype(at::kFloat));
  auto ids = at::empty({M, k}, logits.options().dtype(at::kLong));
  auto h = at::empty({M}, logits.options().dtype(at::kFloat));
  if (M == 0) return {lp, ids, h};
  float* lp_p = lp.mutable_data_ptr<float>();
  int64_t* ids_p = ids.mutable_data_ptr<int64_t>();
  float* h_p = h.mutable_data_ptr<float>();
  switch (logits.scalar_type()) {
    case at::kFloat: topk_entropy_impl<float>(logits, k, parent, lp_p, ids_p, h_p); break;
    case at::kHalf: topk_entropy_impl<c10::Half>(logits, k, parent, lp_p, ids_p, h_p); break;
    case at::kBFloat16: topk_entropy_impl<c10::BFloat16>(logits, k, parent, lp_p, ids_p, h_p); break;
    default: TORCH_INTERNAL_ASSERT(false, "unreachable");
  }
  return {lp, ids, h};
}

// path_entropy [B] float32; bin_edges [nb-1] float32 ascending; bin_extra_depth, bin_budget [nb] int64.
// -> bins, extra_depth, budget: [B] int64.
std::tuple<Tensor, Tensor, Tensor> entropy_bin_policy_cpu(const Tensor& path_entropy, const Tensor& bin_edges,
                                                          const Tensor& bin_extra_depth, const Tensor& bin_budget) {
  constexpr const char* op = "entropy_bin_policy";
  check_bin_policy_inputs(Backend::CPU, op, path_entropy, bin_edges, bin_extra_depth, bin_budget);
  const int64_t B = path_entropy.size(0), ne = bin_edges.size(0), nb = ne + 1;
  const Tensor h = path_entropy.contiguous(), e = bin_edges.contiguous();
  const Tensor xd = bin_extra_depth.contiguous(), bb = bin_budget.contiguous();
  const float* hp = h.const_data_ptr<float>();
  const float* ep = e.const_data_ptr<float>();
  for (int64_t i = 0; i < ne; ++i) {
    HS_CHECK(!std::isnan(ep[i]), op, ": bin_edges[", i, "] is NaN");
    if (i > 0)
      HS_CHECK(ep[i - 1] <= ep[i], op, ": expected bin_edges in ascending order, got bin_edges[", i - 1,
               "] = ", ep[i - 1], " > bin_edges[", i, "] = ", ep[i]);
  }
  auto bins = at::empty({B}, h.options().dtype(at::kLong));
  auto depth = at::empty({B}, h.options().dtype(at::kLong));
  auto budget = at::empty({B}, h.options().dtype(at::kLong));
  int64_t* bp = bins.mutable_data_ptr<int64_t>();
  int64_t* dp = depth.mutable_data_ptr<int64_t>();
  int64_t* np = budget.mutable_data_ptr<int64_t>();
  const int64_t* xdp = xd.const_data_ptr<int64_t>();
  const int64_t* bbp = bb.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    int64_t bin = 0;
    if (std::isnan(hp[b])) {
      bin = nb - 1;
    } else {
      // Edges are ascending: count of edges strictly below h.
      bin = std::lower_bound(ep, ep + ne, hp[b]) - ep;
    }
    bp[b] = bin;
    dp[b] = xdp[bin];
    np[b] = bbp[bin];
  }
  return {bins, depth, budget};
}

TORCH_LIBRARY_IMPL(heterospec, CPU, m) {
  m.impl("topk_entropy", &topk_entropy_cpu);
  m.impl("entropy_bin_policy", &entropy_bin_policy_cpu);
}

}  // namespace heterospec
