// Tree verification on CUDA (docs/design.md, ops 7 and 8): verify_greedy and verify_sampling.
//
// Layouts (contiguous): tree_tokens, first_child, next_sibling, target_ids, coins [B, T];
// num_nodes, final_coins [B]; target_probs [B, T, V] float32; outputs accept_path [B, T],
// accept_len [B], bonus [B], all int64.
//
// The per-request walk is sequential by nature (each step depends on the previous acceptance).
// verify_greedy: one thread per request (verify_greedy_one is __host__ __device__ and unit-tested
// on the host). verify_sampling: one block per request; thread 0 walks, the whole block reduces
// the target row of the current node (row total, residual mass, validity and per-segment masses
// in one pass, double accumulation as the CPU op), and the inverse-CDF bonus draw reads only the
// segment where the target falls (layout below).
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
// One block per request. Thread 0 walks the path; the block streams the current node's target
// row once (the "row pass"): validity, row total, residual mass (children's tokens zeroed) and
// the mass of every segment of the row, kept in shared memory. The bonus draw then needs no
// second pass over the row: warp 0 finds the segment where the cumulative residual passes the
// target (a scan over <= a few hundred segment sums) and scans that one segment (1024 values).
//
// Row layout (row pass and bonus alike): warp w owns the contiguous range [w * Cw, (w + 1) * Cw),
// Cw = verify_sampling_segs_per_warp(V) * kSegElems, walked in segments of kSegElems = 1024 values; segment
// s = w * segs_per_warp + i starts at s * kSegElems, and in it load j (of kSegLoads) of lane l
// covers values start + (j * 32 + l) * 4 + [0, 4) (a warp's load j reads 512 contiguous bytes;
// a warp keeps its kSegLoads loads in flight before using any). Positions >= V read as 0.
constexpr int kSampleThreads = 512;
constexpr int kSegLoads = 8;
constexpr int kSegElems = kSegLoads * 4 * kWarpSize;  // 1024

struct VerifySamplingParams {
  VerifyTree tree;
  const float* probs;  // [B, T, V]
  int64_t V;
  const float* coins;        // [B, T]
  const float* final_coins;  // [B]
  VerifyOut out;
};

HS_HD int64_t verify_sampling_segs_per_warp(int64_t V) {
  const int64_t per_pass = static_cast<int64_t>(kSampleThreads / kWarpSize) * kSegElems;
  const int64_t n = (V + per_pass - 1) / per_pass;
  return n > 0 ? n : 1;
}

// Dynamic shared memory: the distinct child tokens of the current node (<= T entries), then the
// residual and total mass of each segment of the current row (double).
inline size_t verify_sampling_smem_bytes(int64_t T, int64_t V) {
  const int64_t nseg = static_cast<int64_t>(kSampleThreads / kWarpSize) * verify_sampling_segs_per_warp(V);
  return static_cast<size_t>(T > 0 ? T : 1) * sizeof(int64_t) + 2 * static_cast<size_t>(nseg) * sizeof(double);
}

HS_DEV bool is_kid(int64_t v, const int64_t* kids, int nk) {
  for (int q = 0; q < nk; ++q)
    if (kids[q] == v) return true;
  return false;
}

// Four consecutive values from position v0 (a multiple of 4); positions >= V read as 0.
// VEC4: the row is 16-byte aligned and V % 4 == 0.
template <bool VEC4>
HS_DEV float4 load4(const float* row, int64_t v0, int64_t V) {
  if (VEC4) return v0 < V ? __ldg(reinterpret_cast<const float4*>(row + v0)) : make_float4(0.f, 0.f, 0.f, 0.f);
  float4 f;
  f.x = v0 < V ? __ldg(row + v0) : 0.f;
  f.y = v0 + 1 < V ? __ldg(row + v0 + 1) : 0.f;
  f.z = v0 + 2 < V ? __ldg(row + v0 + 2) : 0.f;
  f.w = v0 + 3 < V ? __ldg(row + v0 + 3) : 0.f;
  return f;
}

HS_DEV float f4_at(const float4& f, int c) { return c == 0 ? f.x : c == 1 ? f.y : c == 2 ? f.z : f.w; }

// The lowest lane whose `pred` holds, or kWarpSize when none (every lane gets it).
HS_DEV int warp_first(bool pred) {
  const int lane = threadIdx.x & (kWarpSize - 1);
  return kWarpSize - warp_max(pred ? kWarpSize - lane : 0);
}

// The bonus draw of the row at `row` (warp 0 only; every lane gets the result): inverse CDF of
// the row with the first `nz` entries of `kids` zeroed, at target mass `target`, from the
// per-segment masses `segs` of that row. Rounding (the segment sums and the scans add in other
// orders): a segment found whose scan does not pass the target gives its last value with mass;
// no segment found gives the last segment with mass.
template <bool VEC4>
HS_DEV int64_t bonus_draw(const float* row, int64_t V, int64_t nseg, const double* segs, const int64_t* kids,
                          int nz, double target) {
  const int lane = threadIdx.x & (kWarpSize - 1);
  // 1. The segment where the cumulative mass passes `target`.
  double carry = 0.0, before = 0.0;
  int64_t found = -1, last_seg = -1;
  for (int64_t s0 = 0; s0 < nseg; s0 += kWarpSize) {
    const int64_t s = s0 + lane;
    const double m = s < nseg ? segs[s] : 0.0;
    const double inc = warp_inclusive_scan(m);
    const int first = warp_first(m > 0.0 && carry + inc > target);
    const int top = warp_max(m > 0.0 ? lane : -1);
    if (top >= 0) last_seg = s0 + top;
    if (first < kWarpSize) {
      found = s0 + first;
      before = carry + __shfl_sync(kFullMask, inc - m, first);
      break;
    }
    carry += __shfl_sync(kFullMask, inc, kWarpSize - 1);
  }
  const bool rounding = found < 0;
  if (rounding) found = last_seg;
  if (found < 0) return -1;  // no mass at all (the caller checked the row has some)
  // 2. Inside the segment, in value order.
  const int64_t start = found * kSegElems;
  float4 f[kSegLoads];
#pragma unroll
  for (int j = 0; j < kSegLoads; ++j) f[j] = load4<VEC4>(row, start + (j * kWarpSize + lane) * 4, V);
  double c = before;
  int64_t last_pos = -1;
#pragma unroll
  for (int j = 0; j < kSegLoads; ++j) {
    const int64_t v0 = start + (j * kWarpSize + lane) * 4;
    float x[4];
    double l4 = 0.0;
    int64_t my_last = -1;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float y = f4_at(f[j], q);
      x[q] = (y > 0.f && !(nz > 0 && is_kid(v0 + q, kids, nz))) ? y : 0.f;
      if (x[q] > 0.f) my_last = v0 + q;
      l4 += x[q];
    }
    const double inc = warp_inclusive_scan(l4);
    int64_t mine = -1;
    if (!rounding && l4 > 0.0) {
      double cc = c + (inc - l4);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (x[q] > 0.f) {
          cc += x[q];
          if (cc > target && mine < 0) mine = v0 + q;
        }
      }
    }
    const int first = warp_first(mine >= 0);
    if (first < kWarpSize) return __shfl_sync(kFullMask, mine, first);
    const int top = warp_max(my_last >= 0 ? lane : -1);
    if (top >= 0) last_pos = __shfl_sync(kFullMask, my_last, top);
    c += __shfl_sync(kFullMask, inc, kWarpSize - 1);
  }
  return last_pos;
}

template <int NT, bool VEC4>
__global__ void __launch_bounds__(NT) verify_sampling_kernel(VerifySamplingParams p) {
  constexpr int NW = NT / kWarpSize;
  const int64_t b = blockIdx.x, T = p.tree.T, V = p.V, o = b * T;
  const int64_t spw = verify_sampling_segs_per_warp(V), nseg = static_cast<int64_t>(NW) * spw;
  HS_EXTERN_SMEM(smem);
  int64_t* kids = reinterpret_cast<int64_t*>(smem);                     // [max(T, 1)]
  double* seg_res = reinterpret_cast<double*>(kids + (T > 0 ? T : 1));  // [nseg]
  double* seg_tot = seg_res + nseg;                                      // [nseg]
  __shared__ double red_d[33];
  __shared__ int red_i[33];
  __shared__ int s_nkids;
  __shared__ int64_t s_next, s_bonus;

  const int tid = threadIdx.x, lane = tid & (kWarpSize - 1), warp = tid / kWarpSize;
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

    // ---- row pass: validity, and each segment's total and residual mass ----
    int badl = 0;
    for (int64_t i = 0; i < spw; ++i) {
      const int64_t seg = static_cast<int64_t>(warp) * spw + i, start = seg * kSegElems;
      float4 f[kSegLoads];
#pragma unroll
      for (int j = 0; j < kSegLoads; ++j) f[j] = load4<VEC4>(row, start + (j * kWarpSize + lane) * 4, V);
      double st = 0.0, sr = 0.0;
#pragma unroll
      for (int j = 0; j < kSegLoads; ++j) {
        const int64_t v0 = start + (j * kWarpSize + lane) * 4;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float x = f4_at(f[j], q);
          badl |= (x >= 0.f && x <= 3.0e38f) ? 0 : 1;  // rejects NaN, negative and +inf
          st += x;
          if (x > 0.f && !is_kid(v0 + q, kids, nk)) sr += x;
        }
      }
      st = warp_sum(st);
      sr = warp_sum(sr);
      if (lane == 0) {
        seg_tot[seg] = st;
        seg_res[seg] = sr;
      }
    }
    const int bad = block_sum(badl, red_i);  // (its barrier also publishes the segment sums)
    double tot = 0.0, res = 0.0;
    for (int64_t s = tid; s < nseg; s += NT) {
      tot += seg_tot[s];
      res += seg_res[s];
    }
    tot = block_sum(tot, red_d);
    res = block_sum(res, red_d);
    if (bad != 0 || !(tot > 0.0)) break;  // not a distribution: bonus stays -1

    // ---- acceptance among the children (thread 0, the CPU op's order and arithmetic) ----
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

    // ---- bonus: inverse CDF over the residual (or the full row when the residual has no mass) ----
    const bool use_res = res > 0.0;
    const double target = static_cast<double>(p.final_coins[b]) * (use_res ? res : tot);
    if (warp == 0) {
      const int64_t pick = bonus_draw<VEC4>(row, V, nseg, use_res ? seg_res : seg_tot, kids, use_res ? nk : 0, target);
      if (lane == 0) s_bonus = pick;
    }
    __syncthreads();
    bonus = s_bonus;
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
  const size_t smem = verify_sampling_smem_bytes(p.tree.T, p.V);
  if (vec4)
    launch(verify_sampling_kernel<kSampleThreads, true>, dim3(static_cast<unsigned>(p.tree.B)), dim3(kSampleThreads),
           smem, p);
  else
    launch(verify_sampling_kernel<kSampleThreads, false>, dim3(static_cast<unsigned>(p.tree.B)),
           dim3(kSampleThreads), smem, p);
}

}  // namespace cuda
}  // namespace heterospec
