// CPU kernel: compact_kv_. Contract: docs/design.md, op 9.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "cpu/parallel.h"
#include "op_checks.h"
#include "ops.h"

namespace heterospec {

// k_cache, v_cache [num_layers, B, S, H_kv, D] (same shape, dtype, device; contiguous), written in
// place; accept_path [B, P] int64 (P >= 1), accept_len [B] int64, prefix_lens [B] int64.
// cache[l, b, L_b + i] = cache[l, b, L_b + accept_path[b, i]] for i in [0, accept_len[b]].
void compact_kv_cpu(Tensor& k_cache, Tensor& v_cache, const Tensor& accept_path_in, const Tensor& accept_len_in,
                    const Tensor& prefix_lens_in) {
  constexpr const char* op = "compact_kv_";
  const KvDims d = check_compact_kv_inputs(Backend::CPU, op, k_cache, v_cache, accept_path_in, accept_len_in,
                                           prefix_lens_in);
  const int64_t NL = d.num_layers, B = d.B, S = d.S, P = d.P;
  const Tensor accept_path = accept_path_in.contiguous(), accept_len = accept_len_in.contiguous();
  const Tensor prefix_lens = prefix_lens_in.contiguous();
  const int64_t* path = accept_path.const_data_ptr<int64_t>();
  const int64_t* alen = accept_len.const_data_ptr<int64_t>();
  const int64_t* lp = prefix_lens.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = alen[b], L = lp[b];
    HS_CHECK(n >= 0 && n < P, op, ": expected 0 <= accept_len[", b, "] < accept_path.size(1) = ", P, ", got ", n);
    HS_CHECK(L >= 0 && L < S, op, ": expected 0 <= prefix_lens[", b, "] < S = ", S, ", got ", L);
    HS_CHECK(path[b * P] == 0, op, ": expected accept_path[", b, ", 0] == 0 (the root), got ", path[b * P]);
    for (int64_t i = 1; i <= n; ++i)
      HS_CHECK(path[b * P + i] > path[b * P + i - 1], op, ": expected accept_path[", b,
               ", :accept_len + 1] strictly increasing, got accept_path[", b, ", ", i - 1, "] = ", path[b * P + i - 1],
               " and accept_path[", b, ", ", i, "] = ", path[b * P + i]);
    HS_CHECK(path[b * P + n] < S - L, op, ": accepted slot out of range for request ", b, ": prefix_lens + accept_path[",
             b, ", accept_len] = ", L, " + ", path[b * P + n], " >= S = ", S);
  }
  if (k_cache.numel() == 0) return;
  const int64_t row_bytes = k_cache.size(3) * k_cache.size(4) * static_cast<int64_t>(k_cache.element_size());
  char* bases[2] = {static_cast<char*>(k_cache.mutable_data_ptr()), static_cast<char*>(v_cache.mutable_data_ptr())};
  // One task per (cache, layer, request). Ascending i is read-before-write safe: the source slot
  // L + path[i] >= L + i is never a slot written earlier (those are L + j, j < i <= path[i]).
  int64_t rows = 0;  // rows moved per layer, all requests
  for (int64_t b = 0; b < B; ++b) rows += alen[b];
  const int64_t bytes_per_task = std::max<int64_t>(1, rows * row_bytes / std::max<int64_t>(B, 1));
  at::parallel_for(0, 2 * NL * B, grain_for(bytes_per_task / 4), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t which = t / (NL * B), l = (t / B) % NL, b = t % B;
      char* seq = bases[which] + ((l * B + b) * S + lp[b]) * row_bytes;
      for (int64_t i = 1; i <= alen[b]; ++i) {
        const int64_t src = path[b * P + i];
        if (src != i) std::memcpy(seq + i * row_bytes, seq + src * row_bytes, row_bytes);
      }
    }
  });
}

TORCH_LIBRARY_IMPL(heterospec, CPU, m) { m.impl("compact_kv_", &compact_kv_cpu); }

}  // namespace heterospec
