// CPU kernels: verify_greedy, verify_sampling. Contracts: docs/design.md, ops 7 and 8.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/parallel.h"
#include "op_checks.h"
#include "ops.h"

namespace heterospec {
namespace {

// The shared metadata checks (op_checks.h) plus the link checks: child and sibling positions
// strictly greater than the node, and below num_nodes, so every walk terminates inside the real
// nodes.
TreeInputs check_tree_inputs_cpu(const char* op, const Tensor& tree_tokens, const Tensor& first_child,
                                 const Tensor& next_sibling, const Tensor& num_nodes) {
  TreeInputs in = check_tree_inputs(Backend::CPU, op, tree_tokens, first_child, next_sibling, num_nodes);
  const int64_t* np = in.num_nodes.const_data_ptr<int64_t>();
  const int64_t* fc = in.first_child.const_data_ptr<int64_t>();
  const int64_t* ns = in.next_sibling.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < in.B; ++b) {
    const int64_t n = np[b];
    HS_CHECK(n >= 1 && n <= in.T, op, ": expected 1 <= num_nodes[", b, "] <= T = ", in.T, ", got ", n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t c = fc[b * in.T + i], s = ns[b * in.T + i];
      HS_CHECK(c == -1 || (c > i && c < n), op, ": invalid first_child[", b, ", ", i, "] = ", c,
               "; expected -1 or a position in (", i, ", num_nodes[", b, "] = ", n, ")");
      HS_CHECK(s == -1 || (s > i && s < n), op, ": invalid next_sibling[", b, ", ", i, "] = ", s,
               "; expected -1 or a position in (", i, ", num_nodes[", b, "] = ", n, ")");
    }
  }
  return in;
}

// Sum of a probability row in double, with four independent accumulators (a single running sum
// is bound by the add latency). `ok` is cleared by a NaN, negative or infinite entry.
double checked_row_sum(const float* p, int64_t V, bool& ok) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  bool good = true;
  int64_t v = 0;
  for (; v + 4 <= V; v += 4) {
    const float a = p[v], b = p[v + 1], c = p[v + 2], d = p[v + 3];
    good &= (a >= 0.f) & (b >= 0.f) & (c >= 0.f) & (d >= 0.f);  // false for NaN too
    good &= (a <= 3.0e38f) & (b <= 3.0e38f) & (c <= 3.0e38f) & (d <= 3.0e38f);
    s0 += a;
    s1 += b;
    s2 += c;
    s3 += d;
  }
  for (; v < V; ++v) {
    good &= (p[v] >= 0.f) & (p[v] <= 3.0e38f);
    s0 += p[v];
  }
  ok = good;
  return (s0 + s1) + (s2 + s3);
}

}  // namespace

// tree_tokens, target_ids, first_child, next_sibling [B, T] int64; num_nodes [B] int64.
// -> accept_path [B, T] (root + accepted positions, -1 padded), accept_len [B], bonus [B]; int64.
std::tuple<Tensor, Tensor, Tensor> verify_greedy_cpu(const Tensor& tree_tokens, const Tensor& target_ids_in,
                                                     const Tensor& first_child, const Tensor& next_sibling,
                                                     const Tensor& num_nodes) {
  constexpr const char* op = "verify_greedy";
  const TreeInputs in = check_tree_inputs_cpu(op, tree_tokens, first_child, next_sibling, num_nodes);
  check_tree_like(Backend::CPU, op, "target_ids", target_ids_in, at::kLong, 2, in.B, in.T, tree_tokens);
  const Tensor target_ids = target_ids_in.contiguous();
  const int64_t B = in.B, T = in.T;
  auto opts = in.tokens.options();
  auto accept_path = at::full({B, T}, -1, opts);
  auto accept_len = at::empty({B}, opts);
  auto bonus = at::empty({B}, opts);
  const int64_t* tok = in.tokens.const_data_ptr<int64_t>();
  const int64_t* tgt = target_ids.const_data_ptr<int64_t>();
  const int64_t* fc = in.first_child.const_data_ptr<int64_t>();
  const int64_t* ns = in.next_sibling.const_data_ptr<int64_t>();
  int64_t* path = accept_path.mutable_data_ptr<int64_t>();
  int64_t* alen = accept_len.mutable_data_ptr<int64_t>();
  int64_t* bon = bonus.mutable_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t o = b * T;
    int64_t cur = 0, len = 0;
    path[o] = 0;
    while (true) {
      const int64_t want = tgt[o + cur];
      int64_t next = -1;
      for (int64_t c = fc[o + cur]; c != -1; c = ns[o + c]) {
        if (tok[o + c] == want) {
          next = c;
          break;
        }
      }
      if (next < 0) break;
      cur = next;
      path[o + ++len] = cur;
    }
    alen[b] = len;
    bon[b] = tgt[o + cur];
  }
  return {accept_path, accept_len, bonus};
}

// tree_tokens, first_child, next_sibling [B, T] int64; target_probs [B, T, V] float32 >= 0;
// num_nodes [B] int64; coins [B, T], final_coins [B] float32 in [0, 1).
// -> accept_path [B, T], accept_len [B], bonus [B]; int64.
std::tuple<Tensor, Tensor, Tensor> verify_sampling_cpu(const Tensor& tree_tokens, const Tensor& target_probs_in,
                                                       const Tensor& first_child, const Tensor& next_sibling,
                                                       const Tensor& num_nodes, const Tensor& coins_in,
                                                       const Tensor& final_coins_in) {
  constexpr const char* op = "verify_sampling";
  const TreeInputs in = check_tree_inputs_cpu(op, tree_tokens, first_child, next_sibling, num_nodes);
  const int64_t B = in.B, T = in.T;
  const int64_t V =
      check_verify_sampling_inputs(Backend::CPU, op, in, tree_tokens, target_probs_in, coins_in, final_coins_in);
  const Tensor probs = target_probs_in.contiguous(), coins = coins_in.contiguous();
  const Tensor final_coins = final_coins_in.contiguous();

  const int64_t* tok = in.tokens.const_data_ptr<int64_t>();
  const int64_t* fc = in.first_child.const_data_ptr<int64_t>();
  const int64_t* ns = in.next_sibling.const_data_ptr<int64_t>();
  const int64_t* np = in.num_nodes.const_data_ptr<int64_t>();
  const float* pp = probs.const_data_ptr<float>();
  const float* cp = coins.const_data_ptr<float>();
  const float* fcp = final_coins.const_data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    HS_CHECK(fcp[b] >= 0.f && fcp[b] < 1.f, op, ": expected final_coins[", b, "] in [0, 1), got ", fcp[b]);
    for (int64_t i = 0; i < np[b]; ++i) {
      const float u = cp[b * T + i];
      HS_CHECK(u >= 0.f && u < 1.f, op, ": expected coins[", b, ", ", i, "] in [0, 1), got ", u);
      if (i > 0) {
        const int64_t x = tok[b * T + i];
        HS_CHECK(x >= 0 && x < V, op, ": tree_tokens[", b, ", ", i, "] = ", x, " is not a token id in [0, V = ", V,
                 ")");
      }
    }
  }

  auto opts = in.tokens.options();
  auto accept_path = at::full({B, T}, -1, opts);
  auto accept_len = at::empty({B}, opts);
  auto bonus = at::empty({B}, opts);
  int64_t* path = accept_path.mutable_data_ptr<int64_t>();
  int64_t* alen = accept_len.mutable_data_ptr<int64_t>();
  int64_t* bon = bonus.mutable_data_ptr<int64_t>();

  // First bad (b, node) for the error message, found serially after the parallel walk.
  std::vector<int64_t> bad(B, -1);
  // Each request reads a few rows of V probabilities (2 to 3 passes per visited node).
  at::parallel_for(0, B, grain_for(4 * V), [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> kids;  // distinct child tokens of the current node, sibling order
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o = b * T;
      int64_t cur = 0, len = 0;
      path[o] = 0;
      while (true) {
        const float* p = pp + (o + cur) * V;
        bool ok = true;
        const double total = checked_row_sum(p, V, ok);
        if (!ok || !(total > 0.0)) {
          bad[b] = cur;
          break;
        }
        kids.clear();
        const double u = static_cast<double>(cp[o + cur]) * total;
        double S = 0.0;
        int64_t next = -1;
        for (int64_t c = fc[o + cur]; c != -1; c = ns[o + c]) {
          const int64_t x = tok[o + c];
          bool dup = false;
          for (int64_t y : kids) dup |= (y == x);
          if (dup) continue;
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
        // Rejected all children (or a leaf, kids empty): bonus from p with the children's tokens
        // zeroed, by inverse CDF. Zero-probability tokens never satisfy cum > target.
        auto is_kid = [&](int64_t v) {
          for (int64_t y : kids)
            if (y == v) return true;
          return false;
        };
        double resid = 0.0;  // summed directly, so it is 0 only when the children hold all mass
        for (int64_t v = 0; v < V; ++v)
          if (p[v] > 0.f && !is_kid(v)) resid += p[v];
        if (!(resid > 0.0)) {  // only through rounding in the acceptance sums: use the full p
          kids.clear();
          resid = total;
        }
        const double target = static_cast<double>(fcp[b]) * resid;
        double cum = 0.0;
        int64_t pick = -1, last_pos = -1;
        for (int64_t v = 0; v < V; ++v) {
          if (p[v] <= 0.f || is_kid(v)) continue;
          last_pos = v;
          cum += p[v];
          if (cum > target) {
            pick = v;
            break;
          }
        }
        bon[b] = pick >= 0 ? pick : last_pos;  // rounding: the last token with mass
        break;
      }
      alen[b] = len;
    }
  });
  for (int64_t b = 0; b < B; ++b)
    HS_CHECK(bad[b] < 0, op, ": target_probs[", b, ", ", bad[b],
             "] is not a valid distribution (a negative, NaN or inf entry, or all zeros)");
  return {accept_path, accept_len, bonus};
}

TORCH_LIBRARY_IMPL(heterospec, CPU, m) {
  m.impl("verify_greedy", &verify_greedy_cpu);
  m.impl("verify_sampling", &verify_sampling_cpu);
}

}  // namespace heterospec
