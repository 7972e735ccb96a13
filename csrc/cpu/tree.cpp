// CPU kernels: select_tree_nodes, build_tree, tree_attention_mask, dense_tree_attention_mask.
// Contracts: docs/design.md, ops 2, 4, 5 and 6.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu/parallel.h"
#include "op_checks.h"
#include "ops.h"

namespace heterospec {
namespace {

// num_nodes [B]: 1 <= num_nodes[b] <= T.
void check_num_nodes_values(const char* op, const int64_t* n, int64_t B, int64_t T) {
  for (int64_t b = 0; b < B; ++b)
    HS_CHECK(n[b] >= 1 && n[b] <= T, op, ": expected 1 <= num_nodes[", b, "] <= T = ", T, ", got ", n[b]);
}

void check_prefix_lens_values(const char* op, const int64_t* L, int64_t B) {
  for (int64_t b = 0; b < B; ++b) HS_CHECK(L[b] >= 0, op, ": expected prefix_lens[", b, "] >= 0, got ", L[b]);
}

}  // namespace

// scores [B, C] float32 (-inf = invalid), parents [B, C] int64 (-1 = root), budgets [B] int64.
// -> tree_cand [B, T], tree_parents [B, T], num_nodes [B] (T = max_nodes + 1), all int64.
std::tuple<Tensor, Tensor, Tensor> select_tree_nodes_cpu(const Tensor& scores_in, const Tensor& parents_in,
                                                         const Tensor& budgets_in, int64_t max_nodes) {
  constexpr const char* op = "select_tree_nodes";
  check_select_inputs(Backend::CPU, op, scores_in, parents_in, budgets_in, max_nodes);
  const int64_t B = scores_in.size(0), C = scores_in.size(1);
  const int64_t T = max_nodes + 1;

  const Tensor scores = scores_in.contiguous(), parents = parents_in.contiguous(), budgets = budgets_in.contiguous();
  const float* sp = scores.const_data_ptr<float>();
  const int64_t* pp = parents.const_data_ptr<int64_t>();
  const int64_t* bp = budgets.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    HS_CHECK(bp[b] >= 0 && bp[b] <= max_nodes, op, ": expected 0 <= budgets[", b, "] <= max_nodes = ", max_nodes,
             ", got ", bp[b]);
    for (int64_t c = 0; c < C; ++c) {
      HS_CHECK(!std::isnan(sp[b * C + c]), op, ": scores[", b, ", ", c, "] is NaN");
      const int64_t p = pp[b * C + c];
      HS_CHECK(p >= -1 && p < c, op, ": invalid parents[", b, ", ", c, "] = ", p,
               "; expected -1 (root) or an earlier candidate index in [0, ", c, ")");
    }
  }

  auto opts = scores.options().dtype(at::kLong);
  auto tree_cand = at::full({B, T}, -1, opts);
  auto tree_parents = at::full({B, T}, -1, opts);
  auto num_nodes = at::empty({B}, opts);
  int64_t* cand_p = tree_cand.mutable_data_ptr<int64_t>();
  int64_t* par_p = tree_parents.mutable_data_ptr<int64_t>();
  int64_t* nn_p = num_nodes.mutable_data_ptr<int64_t>();

  at::parallel_for(0, B, grain_for(8 * C), [&](int64_t b0, int64_t b1) {
    constexpr float inf = std::numeric_limits<float>::infinity();
    std::vector<float> eff(C);
    std::vector<int64_t> order, pos(C);
    for (int64_t b = b0; b < b1; ++b) {
      const float* s = sp + b * C;
      const int64_t* par = pp + b * C;
      order.clear();
      for (int64_t c = 0; c < C; ++c) {
        const float pe = par[c] < 0 ? inf : eff[par[c]];
        eff[c] = std::min(s[c], pe);
        if (eff[c] > -inf) order.push_back(c);
      }
      const int64_t n = std::min<int64_t>(bp[b], static_cast<int64_t>(order.size()));
      // Best n by (effective score desc, index asc); then back to index order (parents first).
      auto better = [&](int64_t x, int64_t y) { return eff[x] > eff[y] || (eff[x] == eff[y] && x < y); };
      std::partial_sort(order.begin(), order.begin() + n, order.end(), better);
      std::sort(order.begin(), order.begin() + n);
      int64_t* tc = cand_p + b * T;
      int64_t* tp = par_p + b * T;
      tp[0] = -1;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t c = order[i];
        pos[c] = i + 1;
        tc[i + 1] = c;
        // Ancestor closure (see docs) guarantees the parent was selected, at an earlier position.
        tp[i + 1] = par[c] < 0 ? 0 : pos[par[c]];
      }
      nn_p[b] = n + 1;
    }
  });
  return {tree_cand, tree_parents, num_nodes};
}

// tree_parents [B, T] int64, num_nodes [B] int64, prefix_lens [B] int64.
// -> tree_mask [B, T, T] bool, positions / first_child / next_sibling [B, T] int64.
std::tuple<Tensor, Tensor, Tensor, Tensor> build_tree_cpu(const Tensor& tree_parents_in, const Tensor& num_nodes_in,
                                                          const Tensor& prefix_lens_in) {
  constexpr const char* op = "build_tree";
  check_build_tree_inputs(Backend::CPU, op, tree_parents_in, num_nodes_in, prefix_lens_in);
  const int64_t B = tree_parents_in.size(0), T = tree_parents_in.size(1);
  const Tensor parents = tree_parents_in.contiguous(), num_nodes = num_nodes_in.contiguous();
  const Tensor prefix_lens = prefix_lens_in.contiguous();
  const int64_t* pp = parents.const_data_ptr<int64_t>();
  const int64_t* np = num_nodes.const_data_ptr<int64_t>();
  const int64_t* lp = prefix_lens.const_data_ptr<int64_t>();
  check_num_nodes_values(op, np, B, T);
  check_prefix_lens_values(op, lp, B);
  for (int64_t b = 0; b < B; ++b) {
    HS_CHECK(pp[b * T] == -1, op, ": expected tree_parents[", b, ", 0] == -1 (the root), got ", pp[b * T]);
    for (int64_t i = 1; i < np[b]; ++i) {
      const int64_t p = pp[b * T + i];
      HS_CHECK(p >= 0 && p < i, op, ": invalid tree_parents[", b, ", ", i, "] = ", p,
               "; expected a parent position in [0, ", i, ") (nodes are topologically ordered)");
    }
  }

  auto opts = parents.options();
  // Outputs are filled per request below (no at::zeros / at::full: those run their own parallel
  // fill, which costs more than the work on small trees).
  auto tree_mask = at::empty({B, T, T}, opts.dtype(at::kBool));
  auto positions = at::empty({B, T}, opts);
  auto first_child = at::empty({B, T}, opts);
  auto next_sibling = at::empty({B, T}, opts);
  bool* mp = tree_mask.mutable_data_ptr<bool>();
  int64_t* posp = positions.mutable_data_ptr<int64_t>();
  int64_t* fcp = first_child.mutable_data_ptr<int64_t>();
  int64_t* nsp = next_sibling.mutable_data_ptr<int64_t>();

  at::parallel_for(0, B, grain_for(T * T), [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> depth(T), last_child(T);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = np[b], L = lp[b];
      const int64_t* par = pp + b * T;
      bool* mask = mp + b * T * T;
      int64_t* pos = posp + b * T;
      int64_t* fc = fcp + b * T;
      int64_t* ns = nsp + b * T;
      std::fill(last_child.begin(), last_child.end(), -1);
      std::fill(mask, mask + T * T, false);
      std::fill(fc, fc + T, -1);
      std::fill(ns, ns + T, -1);
      depth[0] = 0;
      mask[0] = true;
      for (int64_t i = 1; i < n; ++i) {
        const int64_t p = par[i];
        depth[i] = depth[p] + 1;
        // Row i = row p (its ancestors, p included) plus i itself; columns >= i are still false.
        std::copy(mask + p * T, mask + p * T + i, mask + i * T);
        mask[i * T + i] = true;
        if (last_child[p] < 0)
          fc[p] = i;
        else
          ns[last_child[p]] = i;
        last_child[p] = i;
      }
      for (int64_t i = 0; i < n; ++i) pos[i] = L + depth[i];
      for (int64_t i = n; i < T; ++i) {
        mask[i * T + i] = true;  // padding rows attend to themselves only
        pos[i] = L;
      }
    }
  });
  return {tree_mask, positions, first_child, next_sibling};
}

// tree_mask [B, T, T] bool, num_nodes [B], prefix_lens [B] int64; mask_numel = sum n_b (L_b + n_b).
// -> custom_mask [mask_numel] bool (FlashInfer ragged layout), mask_indptr [B + 1] int64.
std::tuple<Tensor, Tensor> tree_attention_mask_cpu(const Tensor& tree_mask_in, const Tensor& num_nodes_in,
                                                   const Tensor& prefix_lens_in, int64_t mask_numel) {
  constexpr const char* op = "tree_attention_mask";
  check_tree_attention_mask_inputs(Backend::CPU, op, tree_mask_in, num_nodes_in, prefix_lens_in);
  const int64_t B = tree_mask_in.size(0), T = tree_mask_in.size(1);
  const Tensor tree_mask = tree_mask_in.contiguous(), num_nodes = num_nodes_in.contiguous();
  const Tensor prefix_lens = prefix_lens_in.contiguous();
  const int64_t* np = num_nodes.const_data_ptr<int64_t>();
  const int64_t* lp = prefix_lens.const_data_ptr<int64_t>();
  check_num_nodes_values(op, np, B, T);
  check_prefix_lens_values(op, lp, B);
  auto indptr = at::empty({B + 1}, num_nodes.options());
  int64_t* ip = indptr.mutable_data_ptr<int64_t>();
  ip[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = np[b], L = lp[b];
    HS_CHECK(L <= (std::numeric_limits<int64_t>::max() / 4) / std::max<int64_t>(n, 1), op, ": prefix_lens[", b,
             "] = ", L, " is too large");
    ip[b + 1] = ip[b] + n * (L + n);
  }
  HS_CHECK(mask_numel == ip[B], op, ": expected mask_numel == sum_b num_nodes[b] * (prefix_lens[b] + num_nodes[b]) = ",
           ip[B], ", got ", mask_numel);
  auto custom_mask = at::empty({mask_numel}, tree_mask.options());
  bool* out = custom_mask.mutable_data_ptr<bool>();
  const bool* mp = tree_mask.const_data_ptr<bool>();
  at::parallel_for(0, B, grain_for(B > 0 ? mask_numel / B : 1), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = np[b], L = lp[b], W = L + n;
      bool* blk = out + ip[b];
      for (int64_t i = 0; i < n; ++i) {
        std::fill(blk + i * W, blk + i * W + L, true);
        std::copy(mp + (b * T + i) * T, mp + (b * T + i) * T + n, blk + i * W + L);
      }
    }
  });
  return {custom_mask, indptr};
}

// tree_mask [B, T, T] bool, prefix_lens [B] int64, width >= max_b L_b + T.
// -> [B, T, width] bool: prefix columns true, tree columns from tree_mask, the rest false.
Tensor dense_tree_attention_mask_cpu(const Tensor& tree_mask_in, const Tensor& prefix_lens_in, int64_t width) {
  constexpr const char* op = "dense_tree_attention_mask";
  check_dense_mask_inputs(Backend::CPU, op, tree_mask_in, prefix_lens_in, width);
  const int64_t B = tree_mask_in.size(0), T = tree_mask_in.size(1);
  const Tensor tree_mask = tree_mask_in.contiguous(), prefix_lens = prefix_lens_in.contiguous();
  const int64_t* lp = prefix_lens.const_data_ptr<int64_t>();
  check_prefix_lens_values(op, lp, B);
  for (int64_t b = 0; b < B; ++b)
    HS_CHECK(lp[b] <= width - T, op, ": expected prefix_lens[", b, "] + T <= width, got prefix_lens[", b,
             "] = ", lp[b], ", T = ", T, ", width = ", width);
  auto out = at::empty({B, T, width}, tree_mask.options());
  bool* op_ = out.mutable_data_ptr<bool>();
  const bool* mp = tree_mask.const_data_ptr<bool>();
  at::parallel_for(0, B, grain_for(T * width), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t L = lp[b];
      for (int64_t i = 0; i < T; ++i) {
        bool* row = op_ + (b * T + i) * width;
        std::fill(row, row + L, true);
        std::copy(mp + (b * T + i) * T, mp + (b * T + i + 1) * T, row + L);
        std::fill(row + L + T, row + width, false);
      }
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(heterospec, CPU, m) {
  m.impl("select_tree_nodes", &select_tree_nodes_cpu);
  m.impl("build_tree", &build_tree_cpu);
  m.impl("tree_attention_mask", &tree_attention_mask_cpu);
  m.impl("dense_tree_attention_mask", &dense_tree_attention_mask_cpu);
}

}  // namespace heterospec
