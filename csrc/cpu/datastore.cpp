// CPU kernel: corpus_lookup (the lookup corpus of heterospec/datastore.py). Contract: docs/design.md,
// op 15. A host-side op: the corpus and the request's tokens live on the CPU whatever device the
// models run on (no CUDA kernel).
//
// Layout. corpus [N] int32: token ids, documents separated by SEP = 65535. The corpus read
// backwards is `rev` (rev[j] = corpus[N - 1 - j], SEP before the corpus start); suffix_order [N]
// int32 holds the positions j of rev sorted by their first max_match tokens. The suffixes of rev
// that start with a context's last n tokens *reversed* are one range of suffix_order, and the range
// for n + 1 tokens lies inside it: the longest match narrows one range a token at a time. An
// occurrence at rev position j ends at corpus position N - 1 - j; its continuation starts at N - j.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "op_checks.h"
#include "ops.h"

namespace heterospec {
namespace {

constexpr int64_t kSep = 65535;

struct Corpus {
  const int32_t* tokens;
  const int32_t* order;
  int64_t N;

  // suffix_order[i]. An entry outside [0, N) is an error, checked where it is read (the op reads
  // O(log N + sample) of them; checking all N per call would cost more than the lookup).
  int64_t suffix(int64_t i) const {
    const int64_t j = order[i];
    HS_CHECK(j >= 0 && j < N, "corpus_lookup: expected suffix_order values in [0, N = ", N, "), got suffix_order[", i,
             "] = ", j);
    return j;
  }

  // Token m of the rev suffix at suffix_order[i] (SEP before the corpus start).
  int64_t token(int64_t i, int64_t m) const {
    const int64_t pos = N - 1 - suffix(i) - m;
    return pos >= 0 ? static_cast<int64_t>(tokens[pos]) : kSep;
  }

  // First i in [lo, hi) whose token m is >= t (strict: > t).
  int64_t bound(int64_t lo, int64_t hi, int64_t m, int64_t t, bool strict) const {
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      const int64_t v = token(mid, m);
      if (v < t || (strict && v == t))
        lo = mid + 1;
      else
        hi = mid;
    }
    return lo;
  }
};

}  // namespace

std::tuple<Tensor, Tensor> corpus_lookup_cpu(const Tensor& corpus, const Tensor& suffix_order, const Tensor& context,
                                             int64_t k, int64_t min_match, int64_t max_match, int64_t sample,
                                             double agree) {
  constexpr const char* op = "corpus_lookup";
  check_dtype(op, "corpus", corpus, at::kInt);
  check_dim(op, "corpus", corpus, 1, "[N]");
  check_cpu(op, "corpus", corpus);
  check_contiguous(op, "corpus", corpus);
  check_dtype(op, "suffix_order", suffix_order, at::kInt);
  check_dim(op, "suffix_order", suffix_order, 1, "[N]");
  check_cpu(op, "suffix_order", suffix_order);
  check_contiguous(op, "suffix_order", suffix_order);
  check_size(op, "suffix_order", suffix_order, 0, corpus.size(0), "N = corpus.size(0)");
  check_dtype(op, "context", context, at::kLong);
  check_dim(op, "context", context, 1, "[L]");
  check_cpu(op, "context", context);
  HS_CHECK(k >= 0, op, ": expected k >= 0, got ", k);
  HS_CHECK(max_match >= 1, op, ": expected max_match >= 1, got ", max_match);
  HS_CHECK(min_match >= 1 && min_match <= max_match, op, ": expected 1 <= min_match <= max_match = ", max_match,
           ", got ", min_match);
  HS_CHECK(sample >= 1, op, ": expected sample >= 1, got ", sample);
  HS_CHECK(std::isfinite(agree) && agree >= 0.0 && agree <= 1.0, op, ": expected 0 <= agree <= 1, got ", agree);

  Tensor chain = at::full({k}, -1, context.options());
  Tensor match = at::zeros({4}, context.options());
  int64_t* out = chain.mutable_data_ptr<int64_t>();
  int64_t* stats = match.mutable_data_ptr<int64_t>();
  const Corpus c{corpus.const_data_ptr<int32_t>(), suffix_order.const_data_ptr<int32_t>(), corpus.size(0)};
  const Tensor ctx_c = context.contiguous();
  const int64_t* ctx = ctx_c.const_data_ptr<int64_t>();
  const int64_t L = context.size(0);

  // Phase 1: the longest match, one token of the reversed context at a time (a token the corpus
  // cannot hold ends it).
  int64_t lo = 0, hi = c.N, n = 0;
  for (int64_t m = 0; m < std::min(L, max_match); ++m) {
    const int64_t t = ctx[L - 1 - m];
    if (t < 0 || t >= kSep) break;
    const int64_t a = c.bound(lo, hi, m, t, false);
    const int64_t b = c.bound(a, hi, m, t, true);
    if (a >= b) break;
    lo = a, hi = b, n = m + 1;
  }
  const int64_t count = hi - lo;
  stats[0] = n;
  stats[1] = n > 0 ? count : 0;
  if (n < min_match || k == 0) return {chain, match};

  // Phase 2: the continuations of up to `sample` occurrences, evenly spaced in the range
  // (occurrence lo + i * (count - 1) / (rows - 1)), as corpus positions.
  const int64_t rows = std::min(count, sample);
  std::vector<int64_t> start(rows);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t idx = lo + (rows > 1 ? i * (count - 1) / (rows - 1) : 0);
    start[i] = c.N - c.suffix(idx);
  }
  stats[2] = rows;

  // Phase 3: position by position, the most common next token of the occurrences that agreed so
  // far (the smallest on a tie), while it holds `agree` of them and is not SEP.
  std::vector<char> alive(rows, 1);
  std::vector<int64_t> col;
  col.reserve(rows);
  for (int64_t j = 0; j < k; ++j) {
    col.clear();
    for (int64_t i = 0; i < rows; ++i)
      if (alive[i]) col.push_back(start[i] + j < c.N ? static_cast<int64_t>(c.tokens[start[i] + j]) : kSep);
    std::sort(col.begin(), col.end());
    int64_t best = col[0], best_count = 0;
    for (size_t s = 0; s < col.size();) {
      size_t e = s;
      while (e < col.size() && col[e] == col[s]) ++e;
      if (static_cast<int64_t>(e - s) > best_count) best = col[s], best_count = static_cast<int64_t>(e - s);
      s = e;
    }
    if (j == 0) stats[3] = best_count;
    if (best == kSep || static_cast<double>(best_count) < agree * static_cast<double>(col.size())) break;
    out[j] = best;
    for (int64_t i = 0; i < rows; ++i)
      if (alive[i]) alive[i] = (start[i] + j < c.N ? static_cast<int64_t>(c.tokens[start[i] + j]) : kSep) == best;
  }
  return {chain, match};
}

TORCH_LIBRARY_IMPL(heterospec, CPU, m) { m.impl("corpus_lookup", &corpus_lookup_cpu); }

}  // namespace heterospec
