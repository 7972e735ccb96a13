// Runs every heterospec CUDA kernel (csrc/cuda/kernels/*.cuh, through the same *_run schedules the
// launchers use) on the SIMT emulator (simt_emu.h) and compares with straightforward host
// references written from docs/design.md (same tie-breaking, sentinels and arithmetic as the CPU
// ops in csrc/cpu/). No GPU and no torch needed:
//
//   g++ -std=c++20 -O1 -pthread -I csrc -I /usr/local/cuda/include \
//       tests/cuda_host/test_kernels_emu.cpp -o /tmp/hs_emu && /tmp/hs_emu [filter]
//
// Exit status 0 iff every check passes. `filter` runs only the tests whose name contains it.
// With -g -fsanitize=address,undefined (and ASAN_OPTIONS=detect_stack_use_after_return=0) it
// also checks that no kernel leaves its buffers, including on inputs the CPU ops reject.
#include "simt_emu.h"
// (the emulator must come first: it maps the CUDA keywords)
#include "cuda/kernels/bin_policy.cuh"
#include "cuda/kernels/kv.cuh"
#include "cuda/kernels/topk_entropy.cuh"
#include "cuda/kernels/tree.cuh"
#include "cuda/kernels/verify.cuh"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <string>

namespace hc = heterospec::cuda;

namespace {

int g_failures = 0, g_checks = 0;
std::string g_test;

#define EXPECT(cond, ...)                                          \
  do {                                                             \
    ++g_checks;                                                    \
    if (!(cond)) {                                                 \
      if (++g_failures <= 40) {                                    \
        std::printf("  FAIL [%s] %s:%d: ", g_test.c_str(), __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);                                  \
        std::printf("\n");                                         \
      }                                                            \
    }                                                              \
  } while (0)

auto emu_launch = [](auto kernel, dim3 grid, dim3 block, size_t smem, auto... args) {
  emu::launch(kernel, grid, block, smem, args...);
};

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

bool close(double a, double b, double atol, double rtol) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::fabs(a - b) <= atol + rtol * std::fabs(b);
}

// =============================================================================================
// topk_entropy
// =============================================================================================
struct TopkRef {
  std::vector<float> lp;
  std::vector<int64_t> ids;
  std::vector<float> h;
};

TopkRef ref_topk(const std::vector<float>& x, int M, int V, int64_t stride, int k, const float* parent) {
  TopkRef r;
  r.lp.assign(static_cast<size_t>(M) * k, 0.f);
  r.ids.assign(static_cast<size_t>(M) * k, 0);
  r.h.assign(M, 0.f);
  std::vector<int> idx(V);
  for (int m = 0; m < M; ++m) {
    const float* row = x.data() + m * stride;
    bool nan = false;
    float mx = -kInf;
    for (int v = 0; v < V; ++v) {
      nan |= std::isnan(row[v]);
      if (row[v] > mx) mx = row[v];
    }
    if (nan || !std::isfinite(mx)) {
      for (int i = 0; i < k; ++i) {  // invalid row: -inf scores, ids 0..k-1, entropy NaN
        r.lp[m * k + i] = -kInf;
        r.ids[m * k + i] = i;
      }
      r.h[m] = kNaN;
      continue;
    }
    double s = 0;
    for (int v = 0; v < V; ++v) s += std::exp(static_cast<double>(row[v]) - mx);
    const double lse = mx + std::log(s);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return row[a] > row[b]; });
    for (int i = 0; i < k; ++i) {
      r.ids[m * k + i] = idx[i];
      r.lp[m * k + i] = static_cast<float>(row[idx[i]] - lse);
    }
    const double v0 = row[idx[0]];
    double z = 0, ws = 0;
    for (int i = 0; i < k; ++i) {
      const float v = row[idx[i]];
      if (v == -kInf) continue;
      const double d = v - v0, w = std::exp(d);
      z += w;
      ws += w * d;
    }
    double h = std::log(z) - ws / z;
    h = h > 0 ? h : 0;
    r.h[m] = static_cast<float>((parent ? parent[m] : 0.0) + h);
  }
  return r;
}

template <typename T>
T from_float(float f);
template <>
float from_float<float>(float f) {
  return f;
}
template <>
__half from_float<__half>(float f) {
  return __float2half_rn(f);
}
template <>
__nv_bfloat16 from_float<__nv_bfloat16>(float f) {
  return __float2bfloat16_rn(f);
}

// Runs the kernels on `xf` (values already representable in T) laid out with `stride`.
template <typename T>
void check_topk(const char* what, const std::vector<float>& xf, int M, int V, int64_t stride, int k,
                bool with_parent, bool force_scalar = false, unsigned seed = 0) {
  std::vector<T> x(xf.size());
  for (size_t i = 0; i < xf.size(); ++i) x[i] = from_float<T>(xf[i]);
  std::vector<float> back(xf.size());
  for (size_t i = 0; i < xf.size(); ++i) back[i] = hc::to_float(x[i]);
  std::vector<float> parent(M);
  std::mt19937 rng(seed);
  for (auto& p : parent) p = std::uniform_real_distribution<float>(0.f, 3.f)(rng);
  const TopkRef ref = ref_topk(back, M, V, stride, k, with_parent ? parent.data() : nullptr);

  std::vector<float> lp(static_cast<size_t>(M) * k, -7.f), h(M, -7.f);
  std::vector<int64_t> ids(static_cast<size_t>(M) * k, -7);
  hc::TopkParams p{};
  p.logits = x.data();
  p.row_stride = stride;
  p.M = M;
  p.V = V;
  p.k = k;
  p.parent_entropy = with_parent ? parent.data() : nullptr;
  p.out_logprobs = lp.data();
  p.out_ids = ids.data();
  p.out_entropy = h.data();
  const size_t wsb = hc::topk_workspace_bytes(M, V, k, sizeof(T));
  std::vector<unsigned char> ws(wsb + 16, 0xAB);
  void* wsp = ws.data() + (16 - reinterpret_cast<uintptr_t>(ws.data()) % 16) % 16;
  const bool vec_ok = !force_scalar && reinterpret_cast<uintptr_t>(x.data()) % 16 == 0 &&
                      (stride * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  hc::topk_entropy_run<T>(p, vec_ok, wsb ? wsp : nullptr, emu_launch);

  int bad_ids = 0, bad_lp = 0, bad_h = 0;
  for (int m = 0; m < M; ++m) {
    for (int i = 0; i < k; ++i) {
      const size_t o = static_cast<size_t>(m) * k + i;
      if (ids[o] != ref.ids[o] && bad_ids++ < 3)
        EXPECT(false, "%s: row %d slot %d: id %lld, expected %lld (V=%d k=%d)", what, m, i, (long long)ids[o],
               (long long)ref.ids[o], V, k);
      if (!close(lp[o], ref.lp[o], 2e-5, 2e-6) && bad_lp++ < 3)
        EXPECT(false, "%s: row %d slot %d: logprob %.9g, expected %.9g", what, m, i, lp[o], ref.lp[o]);
    }
    if (!close(h[m], ref.h[m], 1e-5, 1e-6) && bad_h++ < 3)
      EXPECT(false, "%s: row %d: entropy %.9g, expected %.9g", what, m, h[m], ref.h[m]);
  }
  EXPECT(bad_ids == 0 && bad_lp == 0 && bad_h == 0, "%s: %d id / %d logprob / %d entropy mismatches", what,
         bad_ids, bad_lp, bad_h);
}

void test_topk() {
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.f, 3.f);
  auto randn = [&](size_t n, float scale = 1.f) {
    std::vector<float> v(n);
    for (auto& f : v) f = nd(rng) * scale;
    return v;
  };
  // random rows, several sizes (single chunk, several chunks, chunk boundaries)
  struct Case {
    int M, V, k;
  };
  const Case cases[] = {{3, 1, 1}, {2, 7, 7}, {3, 50, 5}, {2, 1000, 64}, {2, 4096, 8}, {2, 4097, 10},
                        {2, 8192, 16}, {2, 8193, 64}, {2, 20000, 33}, {1, 40000, 64}};
  for (const auto& c : cases) {
    const auto x = randn(static_cast<size_t>(c.M) * c.V);
    check_topk<float>("f32", x, c.M, c.V, c.V, c.k, true);
    check_topk<__nv_bfloat16>("bf16", x, c.M, c.V, c.V, c.k, false);
    check_topk<__half>("f16", x, c.M, c.V, c.V, c.k, true);
  }
  // scalar (unaligned) path and strided rows
  {
    const int M = 3, V = 9001, stride = 9011;
    const auto x = randn(static_cast<size_t>(M) * stride);
    check_topk<float>("f32 strided", x, M, V, stride, 12, true);
    check_topk<__nv_bfloat16>("bf16 strided", x, M, V, stride, 12, false);
    check_topk<__half>("f16 forced scalar", x, M, 8192, stride, 64, false, true);
  }
  // ties: small integer logits; all-equal rows (large candidate sets -> bitonic path)
  {
    const int M = 4, V = 30000;
    std::vector<float> x(static_cast<size_t>(M) * V);
    std::uniform_int_distribution<int> small(0, 3);
    for (int m = 0; m < 2; ++m)
      for (int v = 0; v < V; ++v) x[m * V + v] = static_cast<float>(small(rng));
    for (int v = 0; v < V; ++v) x[2 * V + v] = 0.f;
    for (int v = 0; v < V; ++v) x[3 * V + v] = (v % 2) ? -0.0f : 0.0f;  // -0 == +0: ties by id
    for (int k : {1, 17, 64}) {
      check_topk<float>("f32 ties", x, M, V, V, k, false);
      check_topk<__nv_bfloat16>("bf16 ties", x, M, V, V, k, true);
    }
  }
  // adversarial layout: each thread's elements all above the next thread's (ascending ramp)
  {
    const int M = 2, V = 8192 * 3;
    std::vector<float> x(static_cast<size_t>(M) * V);
    for (int v = 0; v < V; ++v) {
      x[v] = static_cast<float>(v % 8192) * 0.001f;
      x[V + v] = -static_cast<float>(v) * 0.001f;
    }
    check_topk<float>("f32 ramp", x, M, V, V, 64, false);
    check_topk<__half>("f16 ramp", x, M, V, V, 64, false);
  }
  // masked vocabulary: mostly -inf, fewer finite entries than k
  {
    const int M = 3, V = 12000, k = 20;
    std::vector<float> x(static_cast<size_t>(M) * V, -kInf);
    std::uniform_int_distribution<int> pos(0, V - 1);
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 5 + 10 * m; ++j) x[m * V + pos(rng)] = nd(rng);
    check_topk<float>("f32 masked", x, M, V, V, k, true);
    check_topk<__nv_bfloat16>("bf16 masked", x, M, V, V, k, false);
  }
  // invalid rows: NaN, +inf, all -inf, next to valid rows
  {
    const int M = 5, V = 9000;
    auto x = randn(static_cast<size_t>(M) * V);
    x[1 * V + 4321] = kNaN;
    x[2 * V + 8999] = kInf;
    for (int v = 0; v < V; ++v) x[3 * V + v] = -kInf;
    check_topk<float>("f32 invalid rows", x, M, V, V, 8, true);
    check_topk<__half>("f16 invalid rows", x, M, V, V, 8, false);
    std::vector<float> y(x.begin(), x.begin() + 5 * 100);
    for (int v = 0; v < 100; ++v) y[3 * 100 + v] = -kInf;
    y[1 * 100 + 7] = kNaN;
    check_topk<float>("f32 invalid rows, one chunk", y, 5, 100, 100, 8, false);
  }
  // many chunks: two merge levels (S > 32)
  {
    const int M = 1, V = 140000;
    const auto x = randn(V, 2.f);
    check_topk<float>("f32 two merge levels", x, M, V, V, 64, true);
    const auto y = randn(2 * 300000, 2.f);
    check_topk<__nv_bfloat16>("bf16 two merge levels", y, 2, 300000, 300000, 10, false);
  }
  // production-like shape, and a randomized sweep of shapes / k / scales
  {
    const auto x = randn(4 * 128256, 2.5f);
    check_topk<__nv_bfloat16>("bf16 [4, 128256]", x, 4, 128256, 128256, 10, true);
    std::uniform_int_distribution<int> Vd(1, 50000), Md(1, 6), kd(1, 64), sd(0, 3);
    for (int trial = 0; trial < 24; ++trial) {
      const int V = Vd(rng), M = Md(rng), k = std::min(V, kd(rng));
      const float scale = std::array<float, 4>{0.01f, 1.f, 5.f, 30.f}[sd(rng)];
      const auto z = randn(static_cast<size_t>(M) * V, scale);
      char what[64];
      std::snprintf(what, sizeof(what), "sweep #%d", trial);
      switch (trial % 3) {
        case 0: check_topk<float>(what, z, M, V, V, k, trial % 2); break;
        case 1: check_topk<__half>(what, z, M, V, V, k, trial % 2); break;
        default: check_topk<__nv_bfloat16>(what, z, M, V, V, k, trial % 2); break;
      }
    }
  }
}

// =============================================================================================
// entropy_bin_policy
// =============================================================================================
void test_bin_policy() {
  std::vector<float> edges = {0.5f, 1.0f, 1.0f, 2.5f};
  std::vector<int64_t> depth = {0, 1, 2, 3, 4}, budget = {10, 20, 30, 40, 50};
  std::vector<float> h = {0.f, 0.5f, 0.50001f, 1.0f, 1.5f, 2.5f, 3.f, kNaN, -kInf, kInf};
  const int64_t B = h.size();
  std::vector<int64_t> bins(B, -9), d(B, -9), n(B, -9);
  hc::BinPolicyParams p{h.data(), edges.data(), depth.data(), budget.data(), B, 4, bins.data(), d.data(), n.data()};
  hc::entropy_bin_policy_run(p, emu_launch);
  for (int64_t b = 0; b < B; ++b) {
    int64_t want = std::isnan(h[b]) ? 4 : std::lower_bound(edges.begin(), edges.end(), h[b]) - edges.begin();
    EXPECT(bins[b] == want && d[b] == depth[want] && n[b] == budget[want], "h=%g: bin %lld, expected %lld", h[b],
           (long long)bins[b], (long long)want);
  }
}

// =============================================================================================
// select_tree_nodes
// =============================================================================================
void ref_select(const float* s, const int64_t* par, int64_t C, int64_t budget, int64_t T, int64_t* tc, int64_t* tp,
                int64_t* nn) {
  std::vector<float> eff(C);
  std::vector<int64_t> order, pos(C);
  for (int64_t c = 0; c < C; ++c) {
    const float pe = par[c] < 0 ? kInf : eff[par[c]];
    eff[c] = std::min(s[c], pe);
    if (eff[c] > -kInf) order.push_back(c);
  }
  const int64_t n = std::min<int64_t>(budget, order.size());
  auto better = [&](int64_t x, int64_t y) { return eff[x] > eff[y] || (eff[x] == eff[y] && x < y); };
  std::partial_sort(order.begin(), order.begin() + n, order.end(), better);
  std::sort(order.begin(), order.begin() + n);
  std::fill(tc, tc + T, -1);
  std::fill(tp, tp + T, -1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = order[i];
    pos[c] = i + 1;
    tc[i + 1] = c;
    tp[i + 1] = par[c] < 0 ? 0 : pos[par[c]];
  }
  *nn = n + 1;
}

// EAGLE-like candidate lists: layer 1 = topk children of the root, then topk^2 per layer.
void make_candidates(std::mt19937& rng, int topk, int depth, int quant, std::vector<float>& s,
                     std::vector<int64_t>& par) {
  std::uniform_real_distribution<float> u(0.f, 1.f);
  s.clear();
  par.clear();
  std::vector<int64_t> frontier;
  for (int i = 0; i < topk; ++i) {
    float lp = std::log(u(rng) * 0.9f + 0.05f);
    if (quant) lp = std::round(lp * quant) / quant;
    s.push_back(lp);
    par.push_back(-1);
    frontier.push_back(i);
  }
  for (int d = 1; d < depth; ++d) {
    std::vector<int64_t> next;
    const int64_t layer0 = s.size();
    for (int64_t f : frontier)
      for (int j = 0; j < topk; ++j) {
        float lp = s[f] + std::log(u(rng) * 0.9f + 0.05f);
        if (quant) lp = std::round(lp * quant) / quant;
        if (u(rng) < 0.03f) lp = -kInf;  // invalid / padding
        s.push_back(lp);
        par.push_back(f);
      }
    // the frontier: topk best of the new layer (like the engine), ties by index
    std::vector<int64_t> idx(s.size() - layer0);
    std::iota(idx.begin(), idx.end(), layer0);
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return s[a] > s[b]; });
    idx.resize(topk);
    frontier = idx;
  }
}

void run_select_case(const char* what, int64_t B, int64_t C, int64_t max_nodes, const std::vector<float>& s,
                     const std::vector<int64_t>& par, const std::vector<int64_t>& budgets) {
  const int64_t T = max_nodes + 1;
  std::vector<int64_t> tc(B * T, -7), tp(B * T, -7), nn(B, -7);
  std::vector<unsigned char> ws;
  hc::SelectParams p{};
  p.scores = s.data();
  p.parents = par.data();
  p.budgets = budgets.data();
  p.B = B;
  p.C = static_cast<int>(C);
  p.max_nodes = max_nodes;
  p.tree_cand = tc.data();
  p.tree_parents = tp.data();
  p.num_nodes = nn.data();
  if (C > hc::kSelectSmemMaxC) {
    ws.assign(B * hc::select_scratch_bytes(C), 0xEE);
    p.workspace = ws.data();
  }
  hc::select_tree_nodes_run(p, emu_launch);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> rc(T), rp(T);
    int64_t rn;
    ref_select(s.data() + b * C, par.data() + b * C, C, budgets[b], T, rc.data(), rp.data(), &rn);
    bool ok = nn[b] == rn;
    for (int64_t t = 0; t < T; ++t) ok = ok && tc[b * T + t] == rc[t] && tp[b * T + t] == rp[t];
    EXPECT(ok, "%s: request %lld (C=%lld, budget=%lld): num_nodes %lld vs %lld", what, (long long)b, (long long)C,
           (long long)budgets[b], (long long)nn[b], (long long)rn);
  }
}

void test_select() {
  std::mt19937 rng(77);
  for (int quant : {0, 4}) {
    for (auto [topk, depth, max_nodes] : {std::tuple{4, 3, 10}, {8, 6, 63}, {10, 7, 100}, {10, 10, 63}}) {
      const int64_t B = 3;
      std::vector<float> s, sb;
      std::vector<int64_t> par, pb;
      std::vector<int64_t> budgets;
      int64_t C = -1;
      for (int64_t b = 0; b < B; ++b) {
        make_candidates(rng, topk, depth, quant, sb, pb);
        C = sb.size();
        s.insert(s.end(), sb.begin(), sb.end());
        par.insert(par.end(), pb.begin(), pb.end());
        budgets.push_back(b == 0 ? max_nodes : (b == 1 ? 0 : std::uniform_int_distribution<int64_t>(1, max_nodes)(rng)));
      }
      run_select_case(quant ? "select quantised" : "select", B, C, max_nodes, s, par, budgets);
    }
  }
  // arbitrary (non-monotone) scores over random forests: exercises the min() rule
  for (int trial = 0; trial < 12; ++trial) {
    const int64_t B = 2, C = std::uniform_int_distribution<int64_t>(1, 700)(rng);
    const int64_t max_nodes = std::uniform_int_distribution<int64_t>(0, 80)(rng);
    std::vector<float> s(B * C);
    std::vector<int64_t> par(B * C), budgets(B);
    std::normal_distribution<float> nd(0.f, 3.f);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t c = 0; c < C; ++c) {
        par[b * C + c] = std::uniform_int_distribution<int64_t>(-1, c - 1)(rng);
        s[b * C + c] = trial % 3 == 2 ? std::round(nd(rng) / 3.f) : nd(rng);  // some with many ties
        if (rng() % 10 == 0) s[b * C + c] = -kInf;
      }
      budgets[b] = std::uniform_int_distribution<int64_t>(0, max_nodes)(rng);
    }
    run_select_case("select random forest", B, C, max_nodes, s, par, budgets);
  }
  // flat ties (all equal scores), invalid candidates, budgets above #valid
  {
    const int64_t B = 2, C = 40, max_nodes = 30;
    std::vector<float> s(B * C, -1.0f);
    std::vector<int64_t> par(B * C);
    for (int64_t c = 0; c < C; ++c) {
      par[c] = c < 5 ? -1 : c % 5;
      par[C + c] = c == 0 ? -1 : c - 1;  // a chain
    }
    for (int64_t c = 10; c < C; c += 3) s[C + c] = -kInf;  // cuts the chain at 10
    s[7] = -kInf;
    run_select_case("select ties/invalid", B, C, max_nodes, s, par, {30, 30});
  }
  // C = 0, and max_nodes = 0
  run_select_case("select empty", 2, 0, 5, {}, {}, {3, 0});
  {
    std::vector<float> s = {-1.f, -2.f};
    std::vector<int64_t> par = {-1, 0};
    run_select_case("select max_nodes=0", 1, 2, 0, s, par, {0});
  }
  // large C: global workspace path
  {
    const int64_t B = 2;
    std::vector<float> s, sb;
    std::vector<int64_t> par, pb;
    int64_t C = 0;
    for (int64_t b = 0; b < B; ++b) {
      make_candidates(rng, 16, 12, b, sb, pb);  // 16 + 11 * 256 = 2832 candidates
      C = sb.size();
      s.insert(s.end(), sb.begin(), sb.end());
      par.insert(par.end(), pb.begin(), pb.end());
    }
    run_select_case("select global workspace", B, C, 200, s, par, {200, 57});
  }
}

// =============================================================================================
// build_tree / tree_attention_mask / dense_tree_attention_mask
// =============================================================================================
struct Trees {
  int64_t B, T;
  std::vector<int64_t> parents, num_nodes, prefix;
};

Trees make_trees(std::mt19937& rng, int64_t B, int64_t T) {
  Trees t{B, T, std::vector<int64_t>(B * T, -1), std::vector<int64_t>(B), std::vector<int64_t>(B)};
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = std::uniform_int_distribution<int64_t>(1, T)(rng);
    t.num_nodes[b] = n;
    t.prefix[b] = std::uniform_int_distribution<int64_t>(0, 70)(rng);
    for (int64_t i = 1; i < n; ++i) {
      // prefer recent parents (deep trees) but allow any earlier one
      const int64_t lo = std::max<int64_t>(0, i - 4);
      t.parents[b * T + i] = std::uniform_int_distribution<int64_t>(rng() % 3 ? lo : 0, i - 1)(rng);
    }
    for (int64_t i = n; i < T; ++i) t.parents[b * T + i] = -1;  // padding (as select_tree_nodes)
  }
  return t;
}

void ref_build_tree(const Trees& t, std::vector<uint8_t>& mask, std::vector<int64_t>& pos, std::vector<int64_t>& fc,
                    std::vector<int64_t>& ns) {
  const int64_t B = t.B, T = t.T;
  mask.assign(B * T * T, 0);
  pos.assign(B * T, 0);
  fc.assign(B * T, -1);
  ns.assign(B * T, -1);
  std::vector<int64_t> depth(T), last(T);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = t.num_nodes[b], L = t.prefix[b];
    const int64_t* par = t.parents.data() + b * T;
    uint8_t* m = mask.data() + b * T * T;
    std::fill(last.begin(), last.end(), -1);
    depth[0] = 0;
    m[0] = 1;
    for (int64_t i = 1; i < n; ++i) {
      const int64_t p = par[i];
      depth[i] = depth[p] + 1;
      std::copy(m + p * T, m + p * T + i, m + i * T);
      m[i * T + i] = 1;
      if (last[p] < 0)
        fc[b * T + p] = i;
      else
        ns[b * T + last[p]] = i;
      last[p] = i;
    }
    for (int64_t i = 0; i < n; ++i) pos[b * T + i] = L + depth[i];
    for (int64_t i = n; i < T; ++i) {
      m[i * T + i] = 1;
      pos[b * T + i] = L;
    }
  }
}

void test_tree_masks() {
  std::mt19937 rng(99);
  for (auto [B, T] : {std::pair<int64_t, int64_t>{1, 1}, {3, 5}, {4, 17}, {2, 64}, {5, 33}}) {
    const Trees t = make_trees(rng, B, T);
    std::vector<uint8_t> rmask;
    std::vector<int64_t> rpos, rfc, rns;
    ref_build_tree(t, rmask, rpos, rfc, rns);

    std::vector<uint8_t> mask(B * T * T, 7);
    std::vector<int64_t> pos(B * T, -7), fc(B * T, -7), ns(B * T, -7);
    hc::BuildTreeParams p{t.parents.data(), t.num_nodes.data(), t.prefix.data(), B, T,
                          reinterpret_cast<bool*>(mask.data()), pos.data(), fc.data(), ns.data()};
    hc::build_tree_run(p, emu_launch);
    EXPECT(mask == rmask, "build_tree mask (B=%lld T=%lld)", (long long)B, (long long)T);
    EXPECT(pos == rpos, "build_tree positions (B=%lld T=%lld)", (long long)B, (long long)T);
    EXPECT(fc == rfc, "build_tree first_child (B=%lld T=%lld)", (long long)B, (long long)T);
    EXPECT(ns == rns, "build_tree next_sibling (B=%lld T=%lld)", (long long)B, (long long)T);

    // tree_attention_mask from a noisy tree mask (the op copies whatever the mask holds)
    std::vector<uint8_t> tm = rmask;
    for (auto& v : tm)
      if (rng() % 7 == 0) v ^= 1;
    std::vector<int64_t> indptr_ref(B + 1, 0);
    for (int64_t b = 0; b < B; ++b)
      indptr_ref[b + 1] = indptr_ref[b] + t.num_nodes[b] * (t.prefix[b] + t.num_nodes[b]);
    const int64_t numel = indptr_ref[B];
    std::vector<uint8_t> cm_ref(numel, 0);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = t.num_nodes[b], L = t.prefix[b], W = L + n;
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t c = 0; c < L; ++c) cm_ref[indptr_ref[b] + i * W + c] = 1;
        for (int64_t j = 0; j < n; ++j) cm_ref[indptr_ref[b] + i * W + L + j] = tm[(b * T + i) * T + j];
      }
    }
    std::vector<uint8_t> cm(numel + 64, 9);  // guard bytes after the end must stay untouched
    std::vector<int64_t> indptr(B + 1, -7);
    hc::TreeAttnMaskParams q{reinterpret_cast<const bool*>(tm.data()), t.num_nodes.data(), t.prefix.data(), B, T,
                             numel, reinterpret_cast<bool*>(cm.data()), indptr.data()};
    hc::tree_attention_mask_run(q, emu_launch);
    EXPECT(indptr == indptr_ref, "tree_attention_mask indptr (B=%lld T=%lld)", (long long)B, (long long)T);
    EXPECT(std::equal(cm_ref.begin(), cm_ref.end(), cm.begin()), "tree_attention_mask values (B=%lld T=%lld)",
           (long long)B, (long long)T);
    EXPECT(std::all_of(cm.begin() + numel, cm.end(), [](uint8_t v) { return v == 9; }),
           "tree_attention_mask wrote past mask_numel");
    // a too-small mask_numel never writes out of bounds
    std::vector<uint8_t> small(numel / 2 + 64, 9);
    q.mask_numel = numel / 2;
    q.custom_mask = reinterpret_cast<bool*>(small.data());
    hc::tree_attention_mask_run(q, emu_launch);
    EXPECT(std::all_of(small.begin() + numel / 2, small.end(), [](uint8_t v) { return v == 9; }),
           "tree_attention_mask with a wrong mask_numel wrote out of bounds");

    // dense mask, several widths (aligned and not)
    int64_t maxL = *std::max_element(t.prefix.begin(), t.prefix.end());
    for (int64_t width : {maxL + T, maxL + T + 1, maxL + T + 13, ((maxL + T + 15) / 16) * 16 + 32}) {
      std::vector<uint8_t> ref(B * T * width, 0);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < T; ++i) {
          uint8_t* row = ref.data() + (b * T + i) * width;
          for (int64_t c = 0; c < t.prefix[b]; ++c) row[c] = 1;
          for (int64_t j = 0; j < T; ++j) row[t.prefix[b] + j] = tm[(b * T + i) * T + j];
        }
      std::vector<uint8_t> out(B * T * width, 7);
      hc::DenseMaskParams d{reinterpret_cast<const bool*>(tm.data()), t.prefix.data(), B, T, width,
                            reinterpret_cast<bool*>(out.data())};
      hc::dense_tree_attention_mask_run(d, emu_launch);
      EXPECT(out == ref, "dense_tree_attention_mask (B=%lld T=%lld width=%lld)", (long long)B, (long long)T,
             (long long)width);
    }
  }
}

// =============================================================================================
// verify_greedy / verify_sampling
// =============================================================================================
struct TreeLinks {
  std::vector<int64_t> tokens, fc, ns;
};

TreeLinks links_of(const Trees& t, std::mt19937& rng, int64_t V) {
  std::vector<uint8_t> m;
  std::vector<int64_t> pos, fc, ns;
  ref_build_tree(t, m, pos, fc, ns);
  TreeLinks l{std::vector<int64_t>(t.B * t.T), fc, ns};
  for (auto& x : l.tokens) x = std::uniform_int_distribution<int64_t>(0, V - 1)(rng);
  return l;
}

void test_verify_greedy() {
  std::mt19937 rng(5);
  for (auto [B, T] : {std::pair<int64_t, int64_t>{1, 1}, {7, 9}, {16, 64}}) {
    const int64_t V = 6;  // tiny vocabulary: many matches, duplicate siblings
    const Trees t = make_trees(rng, B, T);
    TreeLinks l = links_of(t, rng, V);
    std::vector<int64_t> tgt(B * T);
    for (auto& x : tgt) x = std::uniform_int_distribution<int64_t>(0, V - 1)(rng);
    std::vector<int64_t> path(B * T, -7), alen(B, -7), bonus(B, -7);
    hc::VerifyGreedyParams p{{l.tokens.data(), l.fc.data(), l.ns.data(), t.num_nodes.data(), B, T},
                             tgt.data(),
                             {path.data(), alen.data(), bonus.data()}};
    hc::verify_greedy_run(p, emu_launch);
    for (int64_t b = 0; b < B; ++b) {
      // reference walk (CPU op)
      const int64_t o = b * T;
      std::vector<int64_t> rp(T, -1);
      int64_t cur = 0, len = 0;
      rp[0] = 0;
      while (true) {
        int64_t next = -1;
        for (int64_t c = l.fc[o + cur]; c != -1; c = l.ns[o + c])
          if (l.tokens[o + c] == tgt[o + cur]) {
            next = c;
            break;
          }
        if (next < 0) break;
        cur = next;
        rp[++len] = cur;
      }
      EXPECT(std::equal(rp.begin(), rp.end(), path.begin() + o) && alen[b] == len && bonus[b] == tgt[o + cur],
             "verify_greedy request %lld (T=%lld): len %lld vs %lld", (long long)b, (long long)T, (long long)alen[b],
             (long long)len);
    }
  }
}

// The CPU op's walk, for reference.
void ref_verify_sampling(int64_t B, int64_t T, int64_t V, const TreeLinks& l, const std::vector<float>& probs,
                         const std::vector<float>& coins, const std::vector<float>& fcoins, std::vector<int64_t>& path,
                         std::vector<int64_t>& alen, std::vector<int64_t>& bonus) {
  path.assign(B * T, -1);
  alen.assign(B, 0);
  bonus.assign(B, -1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t o = b * T;
    int64_t cur = 0, len = 0;
    path[o] = 0;
    std::vector<int64_t> kids;
    while (true) {
      const float* p = probs.data() + (o + cur) * V;
      double total = 0;
      bool ok = true;
      for (int64_t v = 0; v < V; ++v) {
        ok &= (p[v] >= 0.f && p[v] <= 3.0e38f);
        total += p[v];
      }
      if (!ok || !(total > 0)) break;  // the CPU op raises; the CUDA op flags bonus = -1
      kids.clear();
      const double u = static_cast<double>(coins[o + cur]) * total;
      double S = 0;
      int64_t next = -1;
      for (int64_t c = l.fc[o + cur]; c != -1; c = l.ns[o + c]) {
        const int64_t x = l.tokens[o + c];
        if (std::find(kids.begin(), kids.end(), x) != kids.end()) continue;
        kids.push_back(x);
        S += p[x];
        if (u < S) {
          next = c;
          break;
        }
      }
      if (next >= 0) {
        cur = next;
        path[o + ++len] = cur;
        continue;
      }
      auto is_kid = [&](int64_t v) { return std::find(kids.begin(), kids.end(), v) != kids.end(); };
      double resid = 0;
      for (int64_t v = 0; v < V; ++v)
        if (p[v] > 0.f && !is_kid(v)) resid += p[v];
      if (!(resid > 0)) {
        kids.clear();
        resid = total;
      }
      const double target = static_cast<double>(fcoins[b]) * resid;
      double cum = 0;
      int64_t pick = -1, last = -1;
      for (int64_t v = 0; v < V; ++v) {
        if (p[v] <= 0.f || is_kid(v)) continue;
        last = v;
        cum += p[v];
        if (cum > target) {
          pick = v;
          break;
        }
      }
      bonus[b] = pick >= 0 ? pick : last;
      break;
    }
    alen[b] = len;
  }
}

void test_verify_sampling() {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u01(0.f, 1.f);
  struct Case {
    int64_t B, T, V;
  };
  for (const Case c : {Case{2, 1, 5}, Case{3, 9, 7}, Case{48, 16, 3}, Case{8, 16, 1003}, Case{3, 12, 20000}, Case{2, 8, 4096},
                       Case{3, 6, 70001}, Case{2, 5, 65536}}) {  // the last two: 3 and 2 segments per warp
    const Trees t = make_trees(rng, c.B, c.T);
    TreeLinks l = links_of(t, rng, c.V);
    std::vector<float> probs(c.B * c.T * c.V);
    for (int64_t r = 0; r < c.B * c.T; ++r) {
      float* row = probs.data() + r * c.V;
      const int mode = static_cast<int>(rng() % 5) % 4 == 0 ? 3 : static_cast<int>(rng() % 3);
      for (int64_t v = 0; v < c.V; ++v) {
        float x = u01(rng);
        x = x * x * x;
        if (mode == 1 && rng() % 3) x = 0.f;  // sparse rows (top-k / top-p processed)
        row[v] = x;
      }
      if (mode == 2) {  // peaked on a child's token: deep acceptance
        for (int64_t v = 0; v < c.V; ++v) row[v] *= 1e-4f;
        const int64_t node = r % c.T;
        const int64_t ch = l.fc[r - node + node];
        row[ch >= 0 ? l.tokens[r - node + ch] : 0] = 1.f;
      }
      if (mode == 3) {  // most mass on the children's tokens: deep walks, duplicate siblings matter
        const int64_t node = r % c.T;
        for (int64_t v = 0; v < c.V; ++v) row[v] *= 0.3f / static_cast<float>(c.V);
        for (int64_t ch = l.fc[r]; ch > node && ch < c.T; ch = l.ns[r - node + ch]) row[l.tokens[r - node + ch]] += 0.5f;
      }
    }
    // one invalid row (negative entry) on the root of the last request
    if (c.B > 2) probs[((c.B - 1) * c.T) * c.V + (c.V - 1)] = -1.f;
    std::vector<float> coins(c.B * c.T), fcoins(c.B);
    for (auto& x : coins) x = u01(rng) * 0.999f;
    for (auto& x : fcoins) x = u01(rng) * 0.999f;
    fcoins[0] = 0.f;

    std::vector<int64_t> rpath, ralen, rbonus;
    ref_verify_sampling(c.B, c.T, c.V, l, probs, coins, fcoins, rpath, ralen, rbonus);
    for (int aligned = 0; aligned < 2; ++aligned) {
      std::vector<int64_t> path(c.B * c.T, -7), alen(c.B, -7), bonus(c.B, -7);
      hc::VerifySamplingParams p{{l.tokens.data(), l.fc.data(), l.ns.data(), t.num_nodes.data(), c.B, c.T},
                                 probs.data(),
                                 c.V,
                                 coins.data(),
                                 fcoins.data(),
                                 {path.data(), alen.data(), bonus.data()}};
      const bool vec4 = aligned && reinterpret_cast<uintptr_t>(probs.data()) % 16 == 0 && c.V % 4 == 0;
      hc::verify_sampling_run(p, vec4, emu_launch);
      EXPECT(path == rpath, "verify_sampling path (B=%lld T=%lld V=%lld vec4=%d)", (long long)c.B, (long long)c.T,
             (long long)c.V, vec4);
      EXPECT(alen == ralen, "verify_sampling accept_len (B=%lld T=%lld V=%lld)", (long long)c.B, (long long)c.T,
             (long long)c.V);
      EXPECT(bonus == rbonus, "verify_sampling bonus (B=%lld T=%lld V=%lld): first %lld vs %lld", (long long)c.B,
             (long long)c.T, (long long)c.V, (long long)bonus[0], (long long)rbonus[0]);
    }
  }
}

// =============================================================================================
// compact_kv_
// =============================================================================================
void test_compact_kv() {
  std::mt19937 rng(3);
  struct Case {
    int64_t NL, B, S, row_bytes, P;
    int offset;  // byte offset of the cache base (alignment)
  };
  for (const Case c : {Case{2, 3, 20, 64, 8, 0}, Case{3, 4, 32, 24, 10, 0}, Case{1, 2, 16, 12, 6, 4},
                       Case{2, 2, 16, 6, 5, 2}, Case{1, 3, 12, 3, 4, 1}, Case{4, 5, 40, 256, 12, 0}}) {
    const size_t bytes = c.NL * c.B * c.S * c.row_bytes;
    std::vector<unsigned char> kbuf(bytes + 64), vbuf(bytes + 64);
    for (auto& x : kbuf) x = rng();
    for (auto& x : vbuf) x = rng();
    unsigned char* k = kbuf.data() + (16 - reinterpret_cast<uintptr_t>(kbuf.data()) % 16) % 16 + c.offset;
    unsigned char* v = vbuf.data() + (16 - reinterpret_cast<uintptr_t>(vbuf.data()) % 16) % 16 + c.offset;
    std::vector<int64_t> path(c.B * c.P, -1), alen(c.B), L(c.B);
    for (int64_t b = 0; b < c.B; ++b) {
      L[b] = std::uniform_int_distribution<int64_t>(0, c.S - c.P - 3)(rng);  // L + path < S
      const int64_t n = std::uniform_int_distribution<int64_t>(0, c.P - 1)(rng);
      alen[b] = n;
      // strictly increasing positions in [0, P + 3) starting at 0 (overlapping moves)
      std::vector<int64_t> cand(c.P + 2);
      std::iota(cand.begin(), cand.end(), 1);
      std::shuffle(cand.begin(), cand.end(), rng);
      cand.resize(n);
      std::sort(cand.begin(), cand.end());
      path[b * c.P] = 0;
      for (int64_t i = 0; i < n; ++i) path[b * c.P + 1 + i] = cand[i];
    }
    if (c.B > 2) path[2 * c.P] = 1;  // invalid request (root not at 0): must stay untouched
    std::vector<unsigned char> kref(k, k + bytes), vref(v, v + bytes);
    for (auto* ref : {&kref, &vref})
      for (int64_t l = 0; l < c.NL; ++l)
        for (int64_t b = 0; b < c.B; ++b) {
          if (c.B > 2 && b == 2) continue;
          unsigned char* seq = ref->data() + ((l * c.B + b) * c.S + L[b]) * c.row_bytes;
          std::vector<unsigned char> tmp;  // read everything first (read-before-write)
          for (int64_t i = 0; i <= alen[b]; ++i)
            tmp.insert(tmp.end(), seq + path[b * c.P + i] * c.row_bytes, seq + (path[b * c.P + i] + 1) * c.row_bytes);
          std::copy(tmp.begin(), tmp.end(), seq);
        }
    const int unit = hc::compact_kv_unit(c.row_bytes, reinterpret_cast<uintptr_t>(k), reinterpret_cast<uintptr_t>(v));
    hc::CompactKvParams p{k, v, path.data(), alen.data(), L.data(), c.NL, c.B, c.S, c.P, c.row_bytes / unit};
    hc::compact_kv_run(p, unit, 3, emu_launch);  // 3 blocks: exercises the grid-stride loop
    EXPECT(std::equal(kref.begin(), kref.end(), k) && std::equal(vref.begin(), vref.end(), v),
           "compact_kv (row_bytes=%lld unit=%d)", (long long)c.row_bytes, unit);
  }
}

// =============================================================================================
// Inputs the CPU ops reject (they would need a device sync to raise on CUDA): the kernels must
// stay inside their buffers and terminate. Exact-size buffers, so AddressSanitizer builds
// (-fsanitize=address) catch any out-of-bounds access.
// =============================================================================================
void test_invalid_inputs() {
  std::mt19937 rng(8);
  auto junk = [&](size_t n, int64_t lo, int64_t hi) {
    std::vector<int64_t> v(n);
    for (auto& x : v) x = std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    return v;
  };
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t B = 3, T = 1 + trial % 9, C = 17, V = 5;
    const auto par = junk(B * T, -3, T + 3), n = junk(B, -2, T + 2), L = junk(B, -4, 6);
    std::vector<uint8_t> mask(B * T * T);
    std::vector<int64_t> pos(B * T), fc(B * T), ns(B * T);
    hc::build_tree_run(hc::BuildTreeParams{par.data(), n.data(), L.data(), B, T, reinterpret_cast<bool*>(mask.data()),
                                           pos.data(), fc.data(), ns.data()},
                       emu_launch);
    for (int64_t numel : {int64_t{0}, int64_t{7}, int64_t{40}}) {
      std::vector<uint8_t> cm(numel);
      std::vector<int64_t> ip(B + 1);
      hc::tree_attention_mask_run(hc::TreeAttnMaskParams{reinterpret_cast<const bool*>(mask.data()), n.data(),
                                                         L.data(), B, T, numel, reinterpret_cast<bool*>(cm.data()),
                                                         ip.data()},
                                  emu_launch);
    }
    for (int64_t width : {int64_t{1}, T, T + 9}) {  // narrower than L + T
      std::vector<uint8_t> out(B * T * width);
      hc::dense_tree_attention_mask_run(hc::DenseMaskParams{reinterpret_cast<const bool*>(mask.data()), L.data(), B,
                                                            T, width, reinterpret_cast<bool*>(out.data())},
                                        emu_launch);
    }
    const auto tok = junk(B * T, -3, V + 3), lf = junk(B * T, -3, T + 3), ls = junk(B * T, -3, T + 3);
    std::vector<int64_t> path(B * T), alen(B), bonus(B);
    hc::verify_greedy_run(hc::VerifyGreedyParams{{tok.data(), lf.data(), ls.data(), n.data(), B, T}, tok.data(),
                                                 {path.data(), alen.data(), bonus.data()}},
                          emu_launch);
    std::vector<float> probs(B * T * V), coins(B * T), fcoins(B);
    for (auto& x : probs) x = std::uniform_real_distribution<float>(-0.2f, 1.f)(rng);
    for (auto& x : coins) x = std::uniform_real_distribution<float>(0.f, 1.f)(rng);
    for (auto& x : fcoins) x = std::uniform_real_distribution<float>(0.f, 1.f)(rng);
    hc::verify_sampling_run(hc::VerifySamplingParams{{tok.data(), lf.data(), ls.data(), n.data(), B, T}, probs.data(), V,
                                                     coins.data(), fcoins.data(), {path.data(), alen.data(), bonus.data()}},
                            false, emu_launch);
    for (int64_t b = 0; b < B; ++b)
      EXPECT(alen[b] >= 0 && alen[b] < T && bonus[b] >= -1 && bonus[b] < V, "verify_sampling on junk: len %lld bonus %lld",
             (long long)alen[b], (long long)bonus[b]);
    std::vector<float> sc(B * C);
    for (auto& x : sc) x = std::uniform_real_distribution<float>(-3.f, 0.f)(rng);
    sc[3] = kNaN;
    const auto cp = junk(B * C, -4, C + 4), bud = junk(B, -2, 12);
    const int64_t max_nodes = trial % 6;
    std::vector<int64_t> tc(B * (max_nodes + 1)), tp(B * (max_nodes + 1)), nn(B);
    hc::SelectParams sp{};
    sp.scores = sc.data();
    sp.parents = cp.data();
    sp.budgets = bud.data();
    sp.B = B;
    sp.C = static_cast<int>(C);
    sp.max_nodes = max_nodes;
    sp.tree_cand = tc.data();
    sp.tree_parents = tp.data();
    sp.num_nodes = nn.data();
    hc::select_tree_nodes_run(sp, emu_launch);
    for (int64_t b = 0; b < B; ++b) {
      EXPECT(nn[b] >= 1 && nn[b] <= max_nodes + 1, "select on junk: num_nodes %lld", (long long)nn[b]);
      for (int64_t q = 1; q < nn[b]; ++q)
        EXPECT(tp[b * (max_nodes + 1) + q] >= 0 && tp[b * (max_nodes + 1) + q] < q, "select on junk: parent link");
    }
    const int64_t S = 6, P = T;
    std::vector<unsigned char> kc(2 * B * S * 3), vc(2 * B * S * 3);
    const auto kpath = junk(B * P, -2, S + 2), kalen = junk(B, -2, P + 2);
    hc::CompactKvParams kp{kc.data(), vc.data(), kpath.data(), kalen.data(), L.data(), 2, B, S, P, 3};
    hc::compact_kv_run(kp, 1, 4, emu_launch);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string filter = argc > 1 ? argv[1] : "";
  struct T {
    const char* name;
    void (*fn)();
  };
  const T tests[] = {{"bin_policy", test_bin_policy},         {"compact_kv", test_compact_kv},
                     {"verify_greedy", test_verify_greedy},   {"tree_masks", test_tree_masks},
                     {"select", test_select},                 {"verify_sampling", test_verify_sampling},
                     {"topk", test_topk},                     {"invalid_inputs", test_invalid_inputs}};
  for (const auto& t : tests) {
    if (!filter.empty() && std::string(t.name).find(filter) == std::string::npos) continue;
    g_test = t.name;
    const int f0 = g_failures, c0 = g_checks;
    const auto t0 = std::chrono::steady_clock::now();
    t.fn();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%-16s %s  (%d checks, %.1fs)\n", t.name, g_failures == f0 ? "ok" : "FAILED", g_checks - c0, s);
  }
  std::printf("%d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
