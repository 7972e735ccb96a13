// topk_entropy on CUDA (docs/design.md, op 1): torch-free kernels plus their host-side schedule.
//
// Tensor layouts (raw pointers in TopkParams):
//   logits        [M, V] float32 / float16 / bfloat16, row stride `row_stride` elements, the
//                 vocabulary dimension contiguous.
//   topk_logprobs [M, k] float32, topk_ids [M, k] int64, path_entropy [M] float32 (contiguous).
//   parent_entropy [M] float32 or nullptr.
//
// Design (H100: 132 SMs, 3.35 TB/s; target [64, 128256] bf16 = 16.4 MB):
//   Stage 1 ("split-V"): grid (M, S). Block (r, s) owns chunk s of row r: kTopkThreads = 256
//   threads x E elements (E = 32 for 16-bit dtypes, 16 for float32: four 16-byte loads per
//   thread, all issued before any use), i.e. 8192 / 4096 elements (16 KiB) per block. From
//   registers, with only four __syncthreads per block:
//     - per thread: max, NaN / +inf flag, best (value, id) pair, then sum exp2((x - max) log2 e)
//       (ex2.approx); warps merge (max, sum) online with shuffles, the block in double;
//     - the chunk top-k without sorting the chunk: tau = the k-th best of the 256 per-thread best
//       pairs (warp bitonic sort + rank by binary search across the 8 sorted warp lists) is
//       reached by at least k elements, and only the k threads whose best reaches tau can hold
//       elements >= tau: those (<= k * E, typically ~1.2 k for random logits) are collected in
//       shared memory and ranked exactly (rank counting, or a bitonic sort above 256).
//   64 registers / thread and 19 KB of shared memory: 4 blocks (64 KB of loads in flight) per SM.
//   [64, 128256] bf16 is 16 chunks per row = 1024 blocks (~2 waves): one pass over HBM, no [M, V]
//   temporaries, a few KB of partials.
//   Stage 2 (merge): grid (M, ceil(S / 32)); merges up to 32 partials (max, sum, flag, sorted
//   top-k list) per block: sum rescaling, then the union of the lists pruned by the best k-th
//   entry, ranked exactly. Repeated while more than one partial remains (only for V > 32 chunks:
//   > 262144 16-bit or > 131072 float32 logits). The last level writes the outputs. A row that
//   fits one chunk (S == 1) is finished by stage 1 itself (one launch).
//   Why split-V + a merge launch rather than one block per row: 64 rows would occupy 64 of the
//   132 SMs; splitting gives ~8 blocks per SM to hide HBM latency. The merge reads ~M * S * k * 8
//   bytes (a few KB) but costs a launch (~2 us): see bench/bench_ops_cuda.py; programmatic
//   dependent launch (sm_90) or a cluster-wide merge are the next steps if it matters.
//   Rows that are not 16-byte aligned (e.g. V = 50257 with 16-bit logits) use 1-element loads
//   (same chunking, coalesced, more instructions).
// Ordering: (value desc, id asc) everywhere, exactly as the CPU op. Rows with NaN or +inf, or
// whose logits are all -inf (the CPU op raises on them): topk_logprobs = -inf, topk_ids = 0..k-1
// (valid, distinct ids: safe to gather or embed), path_entropy = NaN. A valid row's
// topk_logprobs[0] is always finite, so `topk_logprobs[:, 0] == -inf` is the per-row error flag
// (heterospec.ops.topk_entropy_invalid); -inf scores are never selected as draft nodes.
#pragma once

#include "../common.cuh"

namespace heterospec {
namespace cuda {

constexpr int kTopkMaxK = 64;
constexpr int kTopkThreads = 256;
constexpr int kTopkMergeGroup = 32;  // partial lists merged by one block of stage 2
constexpr int kTopkCandCap = 2048;   // candidate slots: >= k * E (stage 1), >= 32 * k (stage 2)
constexpr int kTopkAbsentId = 0x7fffffff;       // empty slot of a partial top-k list
constexpr int kTopkSentinelBase = 0x7fff0000;   // thread "no element" ids: base + tid
constexpr int kTopkMaxVocab = kTopkSentinelBase;  // host check: V <= this
constexpr float kLog2e = 1.4426950408889634f;

// Partial result of one chunk (stage 1) or one group of partials (stage 2).
struct TopkPartials {
  double* sum;  // [M, S] sum exp(x - max) over the chunk
  float* max;   // [M, S] chunk max (-inf when the chunk has only -inf)
  int* bad;     // [M, S] chunk has NaN or +inf
  float* val;   // [M, S, k] best values, sorted (value desc, id asc), empty slots -inf
  int* id;      // [M, S, k] their ids, empty slots kTopkAbsentId
};

struct TopkParams {
  const void* logits;
  int64_t row_stride;  // elements between rows
  int M, V, k;
  const float* parent_entropy;  // [M] or nullptr
  float* out_logprobs;          // [M, k]
  int64_t* out_ids;             // [M, k]
  float* out_entropy;           // [M]
};

// ---------------------------------------------------------------------------------------------
// Block-wide helpers (all threads of the block call them).
// ---------------------------------------------------------------------------------------------

// Sorted top-min(k, n) of n candidate pairs in shared memory (n <= kTopkCandCap) into ov / oi
// (k slots; slots >= n get (-inf, kTopkAbsentId)). Small n: exact rank by counting; larger n:
// bitonic sort of the candidates in place. Ends with __syncthreads().
template <int NT>
HS_DEV void block_select_topk(float* cv, int* ci, int n, int k, float* ov, int* oi) {
  const int tid = threadIdx.x;
  if (n <= NT) {
    for (int t = n + tid; t < k; t += NT) {
      ov[t] = neg_inf();
      oi[t] = kTopkAbsentId;
    }
    if (tid < n) {
      const float xv = cv[tid];
      const int xi = ci[tid];
      int rank = 0;
      for (int j = 0; j < n; ++j) rank += beats(cv[j], ci[j], xv, xi) ? 1 : 0;
      if (rank < k) {
        ov[rank] = xv;
        oi[rank] = xi;
      }
    }
  } else {
    int P = 1;
    while (P < n) P <<= 1;
    for (int t = n + tid; t < P; t += NT) {
      cv[t] = neg_inf();
      ci[t] = kTopkAbsentId;
    }
    __syncthreads();
    for (int size = 2; size <= P; size <<= 1) {
      for (int stride = size >> 1; stride > 0; stride >>= 1) {
        for (int t = tid; t < P / 2; t += NT) {
          const int lo = 2 * t - (t & (stride - 1));
          const int hi = lo + stride;
          const bool better_first = (lo & size) == 0;
          const float av = cv[lo], bv = cv[hi];
          const int ai = ci[lo], bi = ci[hi];
          if (beats(bv, bi, av, ai) == better_first) {
            cv[lo] = bv;
            ci[lo] = bi;
            cv[hi] = av;
            ci[hi] = ai;
          }
        }
        __syncthreads();
      }
    }
    for (int t = tid; t < k; t += NT) {  // n > NT >= k: all real
      ov[t] = cv[t];
      oi[t] = ci[t];
    }
  }
  __syncthreads();
}

// Online (max, sum exp(x - max)) merge of (m, s) with (om, os); -inf max = empty.
HS_DEV void merge_max_sum(float& m, float& s, float om, float os) {
  const float nm = fmaxf(m, om);
  if (nm == neg_inf()) return;  // both empty: (m, s) = (-inf, 0)
  const float a = m == neg_inf() ? 0.f : s * fast_exp2((m - nm) * kLog2e);
  const float b = om == neg_inf() ? 0.f : os * fast_exp2((om - nm) * kLog2e);
  m = nm;
  s = a + b;
}

// Writes row `row`'s outputs from its final sorted top-k list (ov / oi in shared memory), the
// row max m and sum exp(x - m) s. Uses warp 0; all threads may call.
HS_DEV void topk_finalize(const TopkParams& p, int row, const float* ov, const int* oi, float m, double s,
                          bool bad) {
  if (threadIdx.x >= kWarpSize) return;
  const int lane = threadIdx.x;
  const int k = p.k;
  const int64_t o = static_cast<int64_t>(row) * k;
  const bool ok = !bad && m > neg_inf() && m < pos_inf() && s > 0.0 && s < 1e300;
  if (!ok) {
    for (int i = lane; i < k; i += kWarpSize) {
      p.out_logprobs[o + i] = neg_inf();
      p.out_ids[o + i] = i;
    }
    if (lane == 0) p.out_entropy[row] = nanf("");
    return;
  }
  const double lse = static_cast<double>(m) + log(s);
  const double v0 = ov[0];
  double z = 0.0, ws = 0.0;
  for (int i = lane; i < k; i += kWarpSize) {
    const float v = ov[i];
    p.out_logprobs[o + i] = static_cast<float>(static_cast<double>(v) - lse);
    p.out_ids[o + i] = oi[i];
    if (v != neg_inf()) {  // zero probability: 0 log 0 = 0
      const double d = static_cast<double>(v) - v0;
      const double w = exp(d);
      z += w;
      ws += w * d;
    }
  }
  z = warp_sum(z);
  ws = warp_sum(ws);
  if (lane == 0) {
    double h = log(z) - ws / z;  // -sum q log q, q = w / z
    h = h > 0.0 ? h : 0.0;
    const double parent = p.parent_entropy ? static_cast<double>(p.parent_entropy[row]) : 0.0;
    p.out_entropy[row] = static_cast<float>(parent + h);
  }
}

// ---------------------------------------------------------------------------------------------
// Stage 1: one chunk of one row per block. grid = (M, S), block = NT threads.
// T: float / __half / __nv_bfloat16. VEC elements per load (16 bytes, or 1 when rows are not
// 16-byte aligned), NLOAD loads per thread; E = VEC * NLOAD elements per thread.
// Thread t's load j covers ids chunk0 + (j * NT + t) * VEC + [0, VEC): coalesced, and a thread's
// ids increase with j.
// ---------------------------------------------------------------------------------------------
template <typename T, int VEC, int NLOAD, int NT>
__global__ void __launch_bounds__(NT) topk_entropy_chunk_kernel(TopkParams p, TopkPartials out, int S) {
  constexpr int E = VEC * NLOAD;
  constexpr int NW = NT / kWarpSize;
  static_assert(NT % kWarpSize == 0 && NT >= kTopkMaxK, "block size");
  static_assert(kTopkMaxK * E <= kTopkCandCap, "candidate buffer too small");

  __shared__ float cand_v[kTopkCandCap];
  __shared__ int cand_i[kTopkCandCap];
  __shared__ float wl_v[NW][kWarpSize];
  __shared__ int wl_i[NW][kWarpSize];
  __shared__ float top_v[kTopkMaxK];
  __shared__ int top_i[kTopkMaxK];
  __shared__ float warp_m[NW], warp_s[NW];
  __shared__ int warp_bad[NW];
  __shared__ float tau_v;
  __shared__ int tau_i;
  __shared__ int cand_n;

  const int row = blockIdx.x, split = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & (kWarpSize - 1), warp = tid / kWarpSize;
  const int V = p.V, k = p.k;
  const T* rowp = static_cast<const T*>(p.logits) + static_cast<int64_t>(row) * p.row_stride;
  const int64_t chunk0 = static_cast<int64_t>(split) * (NT * E);
  if (tid == 0) cand_n = 0;

  // ---- load the chunk (all loads first) ----
  float x[E];
#pragma unroll
  for (int j = 0; j < NLOAD; ++j) {
    const int64_t i0 = chunk0 + static_cast<int64_t>(j * NT + tid) * VEC;
    if (i0 + VEC <= V) {
      load_as_float<T, VEC>(rowp + i0, &x[j * VEC]);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) x[j * VEC + e] = (i0 + e < V) ? to_float(rowp[i0 + e]) : neg_inf();
    }
  }
  auto id_of = [&](int i) -> int {
    return static_cast<int>(chunk0 + static_cast<int64_t>((i / VEC) * NT + tid) * VEC + (i % VEC));
  };

  // ---- per thread: max, NaN / +inf flag, best (value, id) pair; then sum exp(x - max) ----
  float tm = neg_inf();
  int bad = 0;
  float bv = neg_inf();
  int bi = kTopkSentinelBase + tid;  // "no element": loses to every real element, unique per thread
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const int id = id_of(i);
    if (id < V) {
      const float v = x[i];
      bad |= (is_nan(v) || v == pos_inf()) ? 1 : 0;
      tm = fmaxf(tm, v);  // ignores NaN
      if (beats(v, id, bv, bi)) {
        bv = v;
        bi = id;
      }
    }
  }
  float ts = 0.f;  // absent slots hold -inf -> exp2(-inf) = 0; a +inf max is flagged anyway
  if (tm > neg_inf()) {
#pragma unroll
    for (int i = 0; i < E; ++i) ts += fast_exp2((x[i] - tm) * kLog2e);
  }

  // ---- warp level: (max, sum) merge, flag, bitonic sort of the best pairs (better first) ----
  {
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o >>= 1) {
      const float om = __shfl_xor_sync(kFullMask, tm, o);
      const float os = __shfl_xor_sync(kFullMask, ts, o);
      merge_max_sum(tm, ts, om, os);
    }
    bad = warp_max(bad);
    float sv = bv;
    int si = bi;
#pragma unroll
    for (int size = 2; size <= kWarpSize; size <<= 1) {
#pragma unroll
      for (int stride = size >> 1; stride > 0; stride >>= 1) {
        const float ov = __shfl_xor_sync(kFullMask, sv, stride);
        const int oi = __shfl_xor_sync(kFullMask, si, stride);
        const bool keep_better = ((lane & stride) == 0) == ((lane & size) == 0);
        if (beats(ov, oi, sv, si) == keep_better) {
          sv = ov;
          si = oi;
        }
      }
    }
    wl_v[warp][lane] = sv;
    wl_i[warp][lane] = si;
    if (lane == 0) {
      warp_m[warp] = tm;
      warp_s[warp] = ts;
      warp_bad[warp] = bad;
    }
    __syncthreads();
    // tau = k-th best of the per-thread bests: rank of my sorted entry among all NT of them.
    int rank = lane;
    for (int w = 0; w < NW; ++w) {
      if (w == warp) continue;
      int lo = 0, hi = kWarpSize;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (beats(wl_v[w][mid], wl_i[w][mid], sv, si))
          lo = mid + 1;
        else
          hi = mid;
      }
      rank += lo;
    }
    if (rank == k - 1) {
      tau_v = sv;
      tau_i = si;
    }
  }
  // Block max / sum / flag: needed by warp 0 only (it writes the partial or the outputs).
  float m = neg_inf();
  double s = 0.0;
  if (warp == 0) {
    const float wm = lane < NW ? warp_m[lane] : neg_inf();
    m = warp_max(wm);
    double c = 0.0;
    if (lane < NW && wm > neg_inf()) c = static_cast<double>(warp_s[lane]) * exp(static_cast<double>(wm) - m);
    s = warp_sum(c);
    bad = warp_max(lane < NW ? warp_bad[lane] : 0);
  }
  __syncthreads();  // tau

  // ---- collect the elements >= tau (only the k threads whose best reaches tau have any) ----
  {
    const float tv = tau_v;
    const int ti = tau_i;
    if (beats(bv, bi, tv, ti) || bi == ti) {
#pragma unroll
      for (int i = 0; i < E; ++i) {
        const int id = id_of(i);
        if (id < V && (beats(x[i], id, tv, ti) || id == ti)) {
          const int slot = atomicAdd(&cand_n, 1);
          if (slot < kTopkCandCap) {
            cand_v[slot] = x[i];
            cand_i[slot] = id;
          }
        }
      }
    }
    __syncthreads();
  }
  const int n = cand_n < kTopkCandCap ? cand_n : kTopkCandCap;
  block_select_topk<NT>(cand_v, cand_i, n, k, top_v, top_i);

  if (S == 1) {
    topk_finalize(p, row, top_v, top_i, m, s, bad != 0);
    return;
  }
  const int64_t ps = static_cast<int64_t>(row) * S + split;
  if (tid == 0) {
    out.max[ps] = m;
    out.sum[ps] = s;
    out.bad[ps] = bad != 0;
  }
  for (int t = tid; t < k; t += NT) {
    out.val[ps * k + t] = top_v[t];
    out.id[ps * k + t] = top_i[t];
  }
}

// ---------------------------------------------------------------------------------------------
// Stage 2: merges partials [g * 32, g * 32 + 32) of row r per block. grid = (M, S_out).
// Writes partial g of `out` (S_out entries per row), or the outputs when S_out == 1.
// ---------------------------------------------------------------------------------------------
template <int NT>
__global__ void __launch_bounds__(NT)
    topk_entropy_merge_kernel(TopkParams p, TopkPartials in, int S_in, TopkPartials out, int S_out) {
  static_assert(kTopkMergeGroup * kTopkMaxK <= kTopkCandCap, "candidate buffer too small");
  static_assert(kTopkMergeGroup == kWarpSize, "one lane per merged partial");
  __shared__ float cand_v[kTopkCandCap];
  __shared__ int cand_i[kTopkCandCap];
  __shared__ float top_v[kTopkMaxK];
  __shared__ int top_i[kTopkMaxK];
  __shared__ float s_m, tau_v;
  __shared__ double s_s;
  __shared__ int s_bad, tau_i, cand_n;

  const int row = blockIdx.x, g = blockIdx.y, tid = threadIdx.x;
  const int k = p.k;
  const int s0 = g * kTopkMergeGroup;
  const int ns = (S_in - s0) < kTopkMergeGroup ? (S_in - s0) : kTopkMergeGroup;
  const int64_t base = static_cast<int64_t>(row) * S_in + s0;  // first merged partial

  if (tid < kWarpSize) {
    const int lane = tid;
    float ml = neg_inf();
    double sl = 0.0;
    int badl = 0;
    float kv = neg_inf();
    int ki = kTopkAbsentId;
    if (lane < ns) {
      ml = in.max[base + lane];
      sl = in.sum[base + lane];
      badl = in.bad[base + lane];
      kv = in.val[(base + lane) * k + (k - 1)];
      ki = in.id[(base + lane) * k + (k - 1)];
    }
    const float m = warp_max(ml);
    double contrib = 0.0;
    if (lane < ns && ml > neg_inf()) contrib = sl * exp(static_cast<double>(ml) - static_cast<double>(m));
    const double s = warp_sum(contrib);
    const int bad = warp_sum(badl);
    // Best k-th entry among full lists: the merged k-th best is at least as good.
    warp_best(kv, ki);
    if (lane == 0) {
      s_m = m;
      s_s = s;
      s_bad = bad;
      tau_v = kv;  // (-inf, kTopkAbsentId) when no list is full: every real entry beats it
      tau_i = ki;
      cand_n = 0;
    }
  }
  __syncthreads();
  {
    const float tv = tau_v;
    const int ti = tau_i;
    for (int t = tid; t < ns * k; t += NT) {
      const int64_t e = (base + t / k) * k + (t % k);
      const int xi = in.id[e];
      if (xi == kTopkAbsentId) continue;
      const float xv = in.val[e];
      if (beats(xv, xi, tv, ti) || xi == ti) {
        const int slot = atomicAdd(&cand_n, 1);
        if (slot < kTopkCandCap) {
          cand_v[slot] = xv;
          cand_i[slot] = xi;
        }
      }
    }
    __syncthreads();
  }
  const int n = cand_n < kTopkCandCap ? cand_n : kTopkCandCap;
  block_select_topk<NT>(cand_v, cand_i, n, k, top_v, top_i);

  if (S_out == 1) {
    topk_finalize(p, row, top_v, top_i, s_m, s_s, s_bad != 0);
    return;
  }
  const int64_t ps = static_cast<int64_t>(row) * S_out + g;
  if (tid == 0) {
    out.max[ps] = s_m;
    out.sum[ps] = s_s;
    out.bad[ps] = s_bad != 0;
  }
  for (int t = tid; t < k; t += NT) {
    out.val[ps * k + t] = top_v[t];
    out.id[ps * k + t] = top_i[t];
  }
}

// ---------------------------------------------------------------------------------------------
// Host-side schedule (torch-free; shared by the launcher and the host emulator test).
// ---------------------------------------------------------------------------------------------

// Elements per stage-1 block for an element size (bytes).
inline int topk_chunk_elems(int elem_size) { return kTopkThreads * (elem_size == 4 ? 16 : 32); }

// Partial buffers for S chunks per row: doubles first (8-byte alignment), then floats / ints.
inline size_t topk_partials_bytes(int64_t M, int64_t S, int64_t k) {
  const int64_t n = M * S;
  return static_cast<size_t>(n * 8 + n * 4 + n * 4 + n * k * 4 + n * k * 4);
}

inline TopkPartials topk_partials_at(void* base, int64_t M, int64_t S, int64_t k) {
  char* c = static_cast<char*>(base);
  const int64_t n = M * S;
  TopkPartials t;
  t.sum = reinterpret_cast<double*>(c);
  c += n * 8;
  t.max = reinterpret_cast<float*>(c);
  c += n * 4;
  t.bad = reinterpret_cast<int*>(c);
  c += n * 4;
  t.val = reinterpret_cast<float*>(c);
  c += n * k * 4;
  t.id = reinterpret_cast<int*>(c);
  return t;
}

// Number of stage-1 chunks per row.
inline int64_t topk_num_chunks(int64_t V, int elem_size) { return ceil_div(V, topk_chunk_elems(elem_size)); }

// Workspace bytes (two partial buffers: stage 1 and the first merge level, then ping-pong).
inline size_t topk_workspace_bytes(int64_t M, int64_t V, int64_t k, int elem_size) {
  const int64_t S = topk_num_chunks(V, elem_size);
  if (S <= 1) return 0;
  const size_t a = topk_partials_bytes(M, S, k);
  const size_t b = topk_partials_bytes(M, ceil_div(S, kTopkMergeGroup), k);
  return a + ((b + 255) / 256) * 256 + 256;
}

// Launches the whole op. `launch(kernel, grid, block, smem_bytes, args...)` launches one kernel (on the
// current stream in the extension; on host threads in the emulator). `vec_ok`: logits base and
// row stride are 16-byte aligned. `workspace` has topk_workspace_bytes(...) bytes.
template <typename T, class Launch>
void topk_entropy_run(const TopkParams& p, bool vec_ok, void* workspace, Launch&& launch) {
  constexpr int NT = kTopkThreads;
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr int NLOAD = 4;
  const int64_t S = topk_num_chunks(p.V, sizeof(T));
  TopkPartials a{}, b{};
  if (S > 1) {
    a = topk_partials_at(workspace, p.M, S, p.k);
    const size_t off = ((topk_partials_bytes(p.M, S, p.k) + 255) / 256) * 256;
    b = topk_partials_at(static_cast<char*>(workspace) + off, p.M, ceil_div(S, kTopkMergeGroup), p.k);
  }
  const dim3 grid1(p.M, static_cast<unsigned>(S));
  if (vec_ok)
    launch(topk_entropy_chunk_kernel<T, VEC, NLOAD, NT>, grid1, dim3(NT), size_t{0}, p, a, static_cast<int>(S));
  else
    launch(topk_entropy_chunk_kernel<T, 1, VEC * NLOAD, NT>, grid1, dim3(NT), size_t{0}, p, a, static_cast<int>(S));
  int64_t s_in = S;
  TopkPartials cur = a, nxt = b;
  while (s_in > 1) {
    const int64_t s_out = ceil_div(s_in, kTopkMergeGroup);
    launch(topk_entropy_merge_kernel<NT>, dim3(p.M, static_cast<unsigned>(s_out)), dim3(NT), size_t{0}, p, cur,
           static_cast<int>(s_in), nxt, static_cast<int>(s_out));
    s_in = s_out;
    const TopkPartials t = cur;
    cur = nxt;
    nxt = t;  // level >= 2 writes into the (larger) stage-1 buffer: fewer partials than it held
  }
}

}  // namespace cuda
}  // namespace heterospec
