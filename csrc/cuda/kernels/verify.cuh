// Tree verification on CUDA (docs/design.md, ops 7 and 8): verify_greedy and verify_sampling.
//
// Layouts (contiguous): tree_tokens, first_child, next_sibling, target_ids, coins [B, T];
// num_nodes, final_coins [B]; target_probs [B, T, V] float32; outputs accept_path [B, T],
// accept_len [B], bonus [B], all int64.
//
// The per-request walk is sequential by nature (each step depends on the previous acceptance).
// verify_greedy: one thread per request (verify_greedy_one is __host__ __device__ and unit-tested
// on the host). verify_sampling: one block per request; thread 0 walks, the whole block reduces
// the target row of the current node (row total, residual mass and validity in one pass, double
// accumulation as the CPU op) and runs the inverse-CDF bonus draw as a block-wide scan over V.
//
// Links are followed only while they point to a larger position below num_nodes (the CPU op
// validates exactly that and raises otherwise), so every walk terminates on any input.
// Data-dependent errors the CPU op raises on: a target row that is not a distribution (negative,
// NaN or inf entries, or all zeros) stops the walk there with bonus = -1 and that node at
// accept_path[b, accept_len[b]] (the op's error contract: heterospec.ops.verify_sampling_invalid
// reads it on the device, raise_verify_sampling_errors raises the CPU message from one host
// read); an out-of-range draft token has probability 0.
#pragma once

#include "../common.cuh"

namespace heterospec {
namespace cuda {

struct VerifyTree {
  const int64_t* tokens;        // [B, T]
  const int64_t* first_child;   // [B, T]
  const int64_t* next_sibling;  // [B, T]
  const int64_t* num_nodes;     // [B]
  int64_t B, T;
};

struct VerifyOut {
  int64_t* accept_path;  // [B, T]
  int64_t* accept_len;   // [B]
  int64_t* bonus;        // [B]
};

// First child of `cur` / next sibling of child `c`, or -1 (links must point forward, below n).
HS_HD int64_t tree_first_child(const int64_t* fc, int64_t cur, int64_t n) {
  const int64_t c = fc[cur];
  return (c > cur && c < n) ? c : -1;
}
HS_HD int64_t tree_next_sibling(const int64_t* ns, int64_t c, int64_t n) {
  const int64_t s = ns[c];
  return (s > c && s < n) ? s : -1;
}

// ---- verify_greedy ----------------------------------------------------------------------------
// One request: arrays are that request's rows ([T] each). Writes path[0..T), *len, *bonus.
HS_HD void verify_greedy_one(int64_t T, int64_t n, const int64_t* tok, const int64_t* tgt, const int64_t* fc,
                             const int64_t* ns, int64_t* path, int64_t* len_out, int64_t* bonus_out) {
  n = n < 1 ? 1 : (n > T ? T : n);
  int64_t cur = 0, len = 0;
  path[0] = 0;
  while (true) {
    const int64_t want = tgt[cur];
    int64_t next = -1;
    for (int64_t c = tree_first_child(fc, cur, n); c >= 0; c = tree_next_sibling(ns, c, n)) {
      if (tok[c] == want) {
        next = c;
        break;
      }
    }
    if (next < 0) break;
    cur = next;
    path[++len] = cur;  // positions strictly increase below n <= T: len < T
  }
  for (int64_t i = len + 1; i < T; ++i) path[i] = -1;
  *len_out = len;
  *bonus_out = tgt[cur];
}

struct VerifyGreedyParams {
  VerifyTree tree;
  const int64_t* target_ids;  // [B, T]
  VerifyOut out;
};

__global__ void verify_greedy_kernel(VerifyGreedyParams p) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= p.tree.B) return;
  const int64_t T = p.tree.T, o = b * T;
  verify_greedy_one(T, p.tree.num_nodes[b], p.tree.tokens + o, p.target_ids + o, p.tree.first_child + o,
                    p.tree.next_sibling + o, p.out.accept_path + o, p.out.accept_len + b, p.out.bonus + b);
}

template <class Launch>
void verify_greedy_run(const VerifyGreedyParams& p, Launch&& launch) {
  if (p.tree.B == 0 || p.tree.T == 0) return;
  constexpr int NT = 64;
  launch(verify_greedy_kernel, dim3(static_cast<unsigned>(ceil_div(p.tree.B, NT))), dim3(NT), size_t{0}, p);
}

// ---- verify_sampling --------------------------------------------------------------------------
constexpr int kSampleThreads = 512;
constexpr int kSampleItems = 32;  // contiguous elements per thread per inverse-CDF tile
constexpr int kPassLoads = 8;     // 16-byte loads per thread in flight in the row-mass pass

struct VerifySamplingParams {
  VerifyTree tree;
  const float* probs;  // [B, T, V]
  int64_t V;
  const float* coins;        // [B, T]
  const float* final_coins;  // [B]
  VerifyOut out;
};

// Dynamic shared memory: the distinct child tokens of the current node (<= T entries).
inline size_t verify_sampling_smem_bytes(int64_t T) { return static_cast<size_t>(T > 0 ? T : 1) * sizeof(int64_t); }

HS_DEV bool is_kid(int64_t v, const int64_t* kids, int nk) {
  for (int q = 0; q < nk; ++q)
    if (kids[q] == v) return true;
  return false;
}

// VEC4: target_probs base is 16-byte aligned and V % 4 == 0 (every row is then aligned).
template <int NT, bool VEC4>
__global__ void __launch_bounds__(NT) verify_sampling_kernel(VerifySamplingParams p) {
  HS_EXTERN_SMEM(smem);
  int64_t* kids = reinterpret_cast<int64_t*>(smem);
  __shared__ double red_d[33];
  __shared__ int red_i[33];
  __shared__ int64_t red_l[33];
  __shared__ int s_nkids;
  __shared__ int64_t s_next;

  const int64_t b = blockIdx.x, T = p.tree.T, V = p.V, o = b * T;
  const int tid = threadIdx.x;
  const int64_t* tok = p.tree.tokens + o;
  const int64_t* fc = p.tree.first_child + o;
  const int64_t* ns = p.tree.next_sibling + o;
  int64_t n = p.tree.num_nodes[b];
  n = n < 1 ? 1 : (n > T ? T : n);
  int64_t* path = p.out.accept_path + o;

  int64_t cur = 0, len = 0, bonus = -1;
  if (tid == 0) path[0] = 0;
  while (true) {
    // Distinct child tokens of `cur` in sibling order (also the residual's zeroed tokens).
    if (tid == 0) {
      int nk = 0;
      for (int64_t c = tree_first_child(fc, cur, n); c >= 0; c = tree_next_sibling(ns, c, n)) {
        const int64_t x = tok[c];
        if (!is_kid(x, kids, nk)) kids[nk++] = x;
      }
      s_nkids = nk;
    }
    __syncthreads();
    const int nk = s_nkids;
    const float* row = p.probs + (o + cur) * V;

    // One pass over the row: total mass, residual mass (children's tokens zeroed), validity.
    double tot = 0.0, res = 0.0;
    int badl = 0;
    auto visit = [&](int64_t v, float x) {
      badl |= (x >= 0.f && x <= 3.0e38f) ? 0 : 1;  // rejects NaN, negative and +inf
      tot += x;
      if (x > 0.f && !is_kid(v, kids, nk)) res += x;
    };
    // kPassLoads loads per thread are issued before any is used: one block streams a whole row
    // (the path is sequential), so its speed is the bytes it keeps in flight, not the arithmetic.
    // Padding slots read as 0 and change no sum.
    if (VEC4) {
      const float4* row4 = reinterpret_cast<const float4*>(row);
      const int64_t V4 = V / 4;
      for (int64_t q0 = tid; q0 < V4; q0 += static_cast<int64_t>(NT) * kPassLoads) {
        float4 f[kPassLoads];
#pragma unroll
        for (int u = 0; u < kPassLoads; ++u) {
          const int64_t q = q0 + static_cast<int64_t>(u) * NT;
          f[u] = q < V4 ? __ldg(row4 + q) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < kPassLoads; ++u) {
          const int64_t q = q0 + static_cast<int64_t>(u) * NT;
          visit(4 * q, f[u].x);
          visit(4 * q + 1, f[u].y);
          visit(4 * q + 2, f[u].z);
          visit(4 * q + 3, f[u].w);
        }
      }
    } else {
      for (int64_t v0 = tid; v0 < V; v0 += static_cast<int64_t>(NT) * kPassLoads * 4) {
        float x[kPassLoads * 4];
#pragma unroll
        for (int u = 0; u < kPassLoads * 4; ++u) {
          const int64_t v = v0 + static_cast<int64_t>(u) * NT;
          x[u] = v < V ? __ldg(row + v) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < kPassLoads * 4; ++u) visit(v0 + static_cast<int64_t>(u) * NT, x[u]);
      }
    }
    tot = block_sum(tot, red_d);
    res = block_sum(res, red_d);
    const int bad = block_sum(badl, red_i);
    if (bad != 0 || !(tot > 0.0)) break;  // not a distribution: bonus stays -1

    // Acceptance among the children (thread 0, the CPU op's order and arithmetic).
    if (tid == 0) {
      const double u = static_cast<double>(p.coins[o + cur]) * tot;
      double S = 0.0;
      int64_t next = -1;
      int seen = 0;  // the first `seen` entries of kids are the distinct tokens visited so far
      for (int64_t c = tree_first_child(fc, cur, n); c >= 0; c = tree_next_sibling(ns, c, n)) {
        const int64_t x = tok[c];
        if (is_kid(x, kids, seen)) continue;  // repeats an earlier sibling's token
        ++seen;
        S += (x >= 0 && x < V) ? static_cast<double>(row[x]) : 0.0;
        if (u < S) {
          next = c;
          break;
        }
      }
      s_next = next;
    }
    __syncthreads();
    const int64_t next = s_next;
    if (next >= 0) {
      cur = next;
      ++len;
      if (tid == 0) path[len] = cur;
      continue;
    }

    // Bonus: inverse CDF over the residual (or the full row when the residual has no mass).
    int nz = nk;
    if (!(res > 0.0)) {
      nz = 0;
      res = tot;
    }
    const double target = static_cast<double>(p.final_coins[b]) * res;
    double carry = 0.0;
    int64_t pick = -1, last_pos = -1;
    for (int64_t tile0 = 0; tile0 < V; tile0 += static_cast<int64_t>(NT) * kSampleItems) {
      const int64_t v0 = tile0 + static_cast<int64_t>(tid) * kSampleItems;
      float x[kSampleItems];
      if (VEC4 && v0 + kSampleItems <= V) {
#pragma unroll
        for (int q = 0; q < kSampleItems / 4; ++q) {
          const float4 f = __ldg(reinterpret_cast<const float4*>(row + v0) + q);
          x[4 * q] = f.x;
          x[4 * q + 1] = f.y;
          x[4 * q + 2] = f.z;
          x[4 * q + 3] = f.w;
        }
      } else {
#pragma unroll
        for (int e = 0; e < kSampleItems; ++e) x[e] = (v0 + e < V) ? __ldg(row + v0 + e) : 0.f;
      }
      double local = 0.0;
#pragma unroll
      for (int e = 0; e < kSampleItems; ++e) {
        if (!(x[e] > 0.f) || (nz > 0 && is_kid(v0 + e, kids, nz))) x[e] = 0.f;
        if (x[e] > 0.f) last_pos = v0 + e;
        local += x[e];
      }
      double tile_total = 0.0;
      const double pre = carry + block_exclusive_scan(local, red_d, &tile_total);
      int64_t mine = INT64_MAX;
      if (local > 0.0) {
        double c = pre;
        for (int e = 0; e < kSampleItems; ++e) {
          if (x[e] > 0.f) {
            c += x[e];
            if (c > target) {
              mine = v0 + e;
              break;
            }
          }
        }
      }
      const int64_t first = block_min(mine, static_cast<int64_t>(INT64_MAX), red_l);
      if (first != INT64_MAX) {
        pick = first;
        break;
      }
      carry += tile_total;
    }
    if (pick < 0) pick = block_max(last_pos, static_cast<int64_t>(-1), red_l);  // rounding: last token with mass
    bonus = pick;
    break;
  }
  if (tid == 0) {
    for (int64_t i = len + 1; i < T; ++i) path[i] = -1;
    p.out.accept_len[b] = len;
    p.out.bonus[b] = bonus;
  }
}

template <class Launch>
void verify_sampling_run(const VerifySamplingParams& p, bool vec4, Launch&& launch) {
  if (p.tree.B == 0 || p.tree.T == 0) return;
  const size_t smem = verify_sampling_smem_bytes(p.tree.T);
  if (vec4)
    launch(verify_sampling_kernel<kSampleThreads, true>, dim3(static_cast<unsigned>(p.tree.B)), dim3(kSampleThreads),
           smem, p);
  else
    launch(verify_sampling_kernel<kSampleThreads, false>, dim3(static_cast<unsigned>(p.tree.B)),
           dim3(kSampleThreads), smem, p);
}

}  // namespace cuda
}  // namespace heterospec
