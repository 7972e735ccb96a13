// compact_kv_ on CUDA (docs/design.md, op 9): all layers, K and V, every request in one launch.
//
// Layouts: k_cache, v_cache [num_layers, B, S, H_kv, D] contiguous, any dtype (copied as bytes
// in units of U = 16 / 8 / 4 / 2 / 1 bytes: the largest dividing the row size H_kv * D * elem
// size with both bases aligned); accept_path [B, P], accept_len [B], prefix_lens [B] int64.
// cache[l, b, L_b + i] = cache[l, b, L_b + accept_path[b, i]] for i in [1, accept_len[b]]
// (i = 0 is the root, a no-op), with read-before-write semantics.
//
// One thread per (cache, layer, request, U-unit of the row): it owns that column of the request's
// rows and moves them in ascending i, in batches of kKvBatch rows (all loads of a batch, then
// all stores). That is read-before-write safe: a source row L + path[i] >= L + i is never a row
// written earlier (those are L + j, j < i <= path[i]), and within a batch every load precedes
// every store. No other thread touches that column, so no barrier is needed.
// A request whose path the CPU op would reject (path[0] != 0, not strictly increasing, a slot
// past S, accept_len outside [0, P), prefix_lens outside [0, S)) is left untouched.
#pragma once

#include "../common.cuh"

namespace heterospec {
namespace cuda {

constexpr int kKvBatch = 8;

struct CompactKvParams {
  unsigned char* k_cache;
  unsigned char* v_cache;
  const int64_t* accept_path;  // [B, P]
  const int64_t* accept_len;   // [B]
  const int64_t* prefix_lens;  // [B]
  int64_t num_layers, B, S, P;
  int64_t row_units;  // row bytes / U
};

// Number of rows to move for request b (accept_len), or -1 when its inputs are invalid.
HS_HD int64_t compact_kv_checked_len(const CompactKvParams& p, int64_t b) {
  const int64_t n = p.accept_len[b], L = p.prefix_lens[b];
  if (n < 0 || n >= p.P || L < 0 || L >= p.S) return -1;
  const int64_t* path = p.accept_path + b * p.P;
  if (path[0] != 0) return -1;
  for (int64_t i = 1; i <= n; ++i)
    if (path[i] <= path[i - 1]) return -1;
  if (path[n] >= p.S - L) return -1;
  return n;
}

template <typename U>
__global__ void compact_kv_kernel(CompactKvParams p) {
  const int64_t total = 2 * p.num_layers * p.B * p.row_units;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t u = idx % p.row_units;
    int64_t rest = idx / p.row_units;
    const int64_t b = rest % p.B;
    rest /= p.B;
    const int64_t l = rest % p.num_layers;
    const int64_t which = rest / p.num_layers;
    const int64_t n = compact_kv_checked_len(p, b);
    if (n <= 0) continue;
    const int64_t L = p.prefix_lens[b];
    U* base = reinterpret_cast<U*>(which == 0 ? p.k_cache : p.v_cache) + ((l * p.B + b) * p.S + L) * p.row_units + u;
    const int64_t* path = p.accept_path + b * p.P;
    for (int64_t i0 = 1; i0 <= n; i0 += kKvBatch) {
      U buf[kKvBatch];
#pragma unroll
      for (int j = 0; j < kKvBatch; ++j) {
        const int64_t i = i0 + j;
        if (i <= n) buf[j] = base[path[i] * p.row_units];
      }
#pragma unroll
      for (int j = 0; j < kKvBatch; ++j) {
        const int64_t i = i0 + j;
        if (i <= n && path[i] != i) base[i * p.row_units] = buf[j];
      }
    }
  }
}

// Largest copy unit (bytes) dividing the row size with both bases aligned to it.
inline int compact_kv_unit(int64_t row_bytes, uintptr_t k_base, uintptr_t v_base) {
  for (int u = 16; u > 1; u >>= 1)
    if (row_bytes % u == 0 && k_base % u == 0 && v_base % u == 0) return u;
  return 1;
}

// `unit` from compact_kv_unit; p.row_units = row_bytes / unit. `max_blocks` caps the grid (the
// kernel is grid-stride).
template <class Launch>
void compact_kv_run(CompactKvParams p, int unit, int64_t max_blocks, Launch&& launch) {
  const int64_t total = 2 * p.num_layers * p.B * p.row_units;
  if (total == 0) return;
  constexpr int NT = 256;
  int64_t blocks = ceil_div(total, NT);
  if (blocks > max_blocks) blocks = max_blocks;
  const dim3 grid(static_cast<unsigned>(blocks)), block(NT);
  switch (unit) {
    case 16: launch(compact_kv_kernel<uint4>, grid, block, size_t{0}, p); break;
    case 8: launch(compact_kv_kernel<uint2>, grid, block, size_t{0}, p); break;
    case 4: launch(compact_kv_kernel<uint32_t>, grid, block, size_t{0}, p); break;
    case 2: launch(compact_kv_kernel<uint16_t>, grid, block, size_t{0}, p); break;
    default: launch(compact_kv_kernel<uint8_t>, grid, block, size_t{0}, p); break;
  }
}

}  // namespace cuda
}  // namespace heterospec
