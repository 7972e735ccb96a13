// Tree ops on CUDA (docs/design.md, ops 2, 4, 5, 6): select_tree_nodes, build_tree,
// tree_attention_mask, dense_tree_attention_mask. Torch-free kernels plus host-side schedules.
//
// Input validation that needs the data (parent ranges, budgets, num_nodes, prefix_lens, NaN
// scores, mask_numel) raises on the CPU; on CUDA it would need a device sync, so the kernels are
// written to stay memory-safe and terminate on any input, with unspecified values for inputs the
// CPU op rejects: NaN scores and out-of-range parents count as invalid candidates (-inf);
// budgets / num_nodes are clamped to their ranges, negative prefix lengths to 0; tree walks stop
// at a link that does not point to a smaller position; mask writes never leave their tensors.
#pragma once

#include "../common.cuh"

namespace heterospec {
namespace cuda {

// =============================================================================================
// select_tree_nodes: one block per request.
//   scores [B, C] float32, parents [B, C] int64, budgets [B] int64 (contiguous);
//   tree_cand, tree_parents [B, T] int64 with T = max_nodes + 1; num_nodes [B] int64.
// Steps: (1) effective score e[c] = min(scores[c], e[parent]) by pointer jumping (log2(depth)
// rounds, ping-pong buffers); (2) N = min(budget, #(e > -inf)); (3) radix select (4 x 8-bit
// digits over an order-preserving uint32 key of e) finds the key of the N-th best; ties at that
// key are taken in index order (block scan); (4) a block scan over the selection flags in index
// order gives each selected candidate its tree position; parents are remapped through it.
// Per-candidate scratch: 16 bytes (2 x float + 2 x int), in dynamic shared memory when C is
// small (<= kSelectSmemMaxC), else in a global workspace of B * 16 * C bytes.
// =============================================================================================
constexpr int kSelectThreads = 512;
constexpr int kSelectSmemMaxC = 2560;  // 40 KiB of dynamic shared memory

struct SelectParams {
  const float* scores;
  const int64_t* parents;
  const int64_t* budgets;
  int64_t B;
  int C;
  int64_t max_nodes;
  int64_t* tree_cand;
  int64_t* tree_parents;
  int64_t* num_nodes;
  unsigned char* workspace;  // nullptr: use dynamic shared memory
};

HS_HD size_t select_scratch_bytes(int64_t C) { return static_cast<size_t>(C) * 16; }

template <int NT>
__global__ void __launch_bounds__(NT) select_tree_nodes_kernel(SelectParams p) {
  HS_EXTERN_SMEM(smem);
  __shared__ int hist[256];
  __shared__ int red[33];
  __shared__ int s_digit, s_above;

  const int b = blockIdx.x, tid = threadIdx.x;
  const int C = p.C;
  unsigned char* ws = p.workspace ? p.workspace + static_cast<size_t>(b) * select_scratch_bytes(C) : smem;
  float* const val0 = reinterpret_cast<float*>(ws);
  float* const val1 = val0 + C;
  int* const anc0 = reinterpret_cast<int*>(ws + 8 * static_cast<size_t>(C));
  int* const anc1 = anc0 + C;
  // Thread tid owns candidates [c0, c1): contiguous, so loops run in index order.
  const int per = static_cast<int>(ceil_div(C, NT));
  const int c0 = tid * per < C ? tid * per : C;
  const int c1 = c0 + per < C ? c0 + per : C;
  const float* sc = p.scores + static_cast<int64_t>(b) * C;
  const int64_t* pa = p.parents + static_cast<int64_t>(b) * C;

  for (int c = c0; c < c1; ++c) {
    float s = sc[c];
    int64_t q = pa[c];
    if (is_nan(s)) s = neg_inf();
    if (q < -1 || q >= c) {
      s = neg_inf();
      q = -1;
    }
    val0[c] = s;
    anc0[c] = static_cast<int>(q);
  }
  __syncthreads();

  // (1) pointer jumping: after round r, val = min over the 2^r nearest ancestors (and self).
  float *vcur = val0, *vnxt = val1;
  int *acur = anc0, *anxt = anc1;
  while (true) {
    int more = 0;
    for (int c = c0; c < c1; ++c) {
      const int a = acur[c];
      float v = vcur[c];
      int na = -1;
      if (a >= 0) {
        v = fminf(v, vcur[a]);
        na = acur[a];
      }
      vnxt[c] = v;
      anxt[c] = na;
      more |= (na >= 0) ? 1 : 0;
    }
    float* tv = vcur;
    vcur = vnxt;
    vnxt = tv;
    int* ta = acur;
    acur = anxt;
    anxt = ta;
    if (!__syncthreads_or(more)) break;
  }

  // (2) keys (0 = invalid; every valid key is > 0) and the number of valid candidates.
  const float* e = vcur;
  uint32_t* key = reinterpret_cast<uint32_t*>(vnxt);
  int nv = 0;
  for (int c = c0; c < c1; ++c) {
    const float ev = e[c];
    const bool valid = ev > neg_inf();
    key[c] = valid ? float_order_key(ev) : 0u;
    nv += valid ? 1 : 0;
  }
  const int n_valid = block_sum(nv, red);  // also orders the key writes before the reads below
  int64_t budget = p.budgets[b];
  budget = budget < 0 ? 0 : (budget > p.max_nodes ? p.max_nodes : budget);
  const int N = static_cast<int>(budget < n_valid ? budget : n_valid);

  // (3) radix select: Kstar = key of the N-th best; `remaining` ties at Kstar are taken.
  uint32_t prefix = 0, pmask = 0;
  int remaining = N;
  if (N > 0) {
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int t = tid; t < 256; t += NT) hist[t] = 0;
      __syncthreads();
      for (int c = c0; c < c1; ++c) {
        const uint32_t kc = key[c];
        if (kc != 0u && (kc & pmask) == prefix) atomicAdd(&hist[(kc >> shift) & 255u], 1);
      }
      __syncthreads();
      if (tid < kWarpSize) {  // lane l owns digits 255 - 8l down to 248 - 8l
        int local = 0;
        for (int j = 0; j < 8; ++j) local += hist[255 - 8 * tid - j];
        const int inc = warp_inclusive_scan(local);
        const int ex = inc - local;
        if (ex < remaining && remaining <= inc) {
          int above = ex;
          for (int j = 0; j < 8; ++j) {
            const int d = 255 - 8 * tid - j;
            if (above + hist[d] >= remaining) {
              s_digit = d;
              s_above = above;
              break;
            }
            above += hist[d];
          }
        }
      }
      __syncthreads();
      prefix |= static_cast<uint32_t>(s_digit) << shift;
      pmask |= 255u << shift;
      remaining -= s_above;
    }
  }
  const uint32_t kstar = prefix;
  const int need_ties = remaining;

  // (4) selection flags in index order: key > Kstar, or key == Kstar among the first need_ties.
  int ties = 0;
  if (N > 0)
    for (int c = c0; c < c1; ++c) ties += (key[c] == kstar) ? 1 : 0;
  int total = 0;
  const int tie_base = block_exclusive_scan(ties, red, &total);
  auto selected = [&](int c, int& tie_rank) -> bool {
    if (N == 0) return false;
    const uint32_t kc = key[c];
    if (kc > kstar) return true;
    if (kc == kstar) return tie_rank++ < need_ties;
    return false;
  };
  int nsel = 0;
  {
    int tr = tie_base;
    for (int c = c0; c < c1; ++c) nsel += selected(c, tr) ? 1 : 0;
  }
  const int pos_base = block_exclusive_scan(nsel, red, &total);
  int* pos_of = acur;  // the final ancestor links are no longer needed
  {
    int tr = tie_base, pos = pos_base;
    for (int c = c0; c < c1; ++c)
      if (selected(c, tr)) pos_of[c] = ++pos;  // tree positions start at 1
  }
  __syncthreads();

  const int64_t T = p.max_nodes + 1;
  int64_t* tc = p.tree_cand + static_cast<int64_t>(b) * T;
  int64_t* tp = p.tree_parents + static_cast<int64_t>(b) * T;
  {
    int tr = tie_base;
    for (int c = c0; c < c1; ++c) {
      if (!selected(c, tr)) continue;
      const int q = pos_of[c];
      const int64_t par = pa[c];
      tc[q] = c;
      tp[q] = par < 0 ? 0 : pos_of[par];  // closed under ancestors: the parent is selected
    }
  }
  for (int64_t t = tid; t < T; t += NT) {
    if (t == 0 || t > N) {
      tc[t] = -1;
      tp[t] = -1;
    }
  }
  if (tid == 0) p.num_nodes[b] = N + 1;
}

// `workspace`: nullptr when C <= kSelectSmemMaxC, else B * select_scratch_bytes(C) bytes.
template <class Launch>
void select_tree_nodes_run(const SelectParams& p, Launch&& launch) {
  if (p.B == 0) return;
  const size_t smem = p.workspace ? 0 : select_scratch_bytes(p.C);
  launch(select_tree_nodes_kernel<kSelectThreads>, dim3(static_cast<unsigned>(p.B)), dim3(kSelectThreads), smem,
         p);
}

// =============================================================================================
// build_tree: one thread per tree_mask element (b, i, j); the j == 0 thread of each row also
// writes positions / first_child / next_sibling of node i.
//   tree_parents [B, T], num_nodes [B], prefix_lens [B] int64; tree_mask [B, T, T] bool;
//   positions, first_child, next_sibling [B, T] int64.
// mask[b, i, j] walks i's ancestor chain while it is above j (parents < children), so it costs
// O(depth); first_child / next_sibling scan the later positions (O(T) per node).
// =============================================================================================
struct BuildTreeParams {
  const int64_t* parents;
  const int64_t* num_nodes;
  const int64_t* prefix_lens;
  int64_t B, T;
  bool* tree_mask;
  int64_t* positions;
  int64_t* first_child;
  int64_t* next_sibling;
};

HS_HD int64_t clamp_nodes(int64_t n, int64_t T) { return n < 1 ? 1 : (n > T ? T : n); }

// Is j == i or an ancestor of i (0 <= j, i < n)? Stops at an invalid link.
HS_HD bool is_ancestor_or_self(const int64_t* par, int64_t i, int64_t j) {
  int64_t cur = i;
  while (cur > j) {
    const int64_t q = par[cur];
    if (q < 0 || q >= cur) break;
    cur = q;
  }
  return cur == j;
}

__global__ void build_tree_kernel(BuildTreeParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t TT = p.T * p.T;
  if (idx >= p.B * TT) return;
  const int64_t b = idx / TT, rem = idx - b * TT, i = rem / p.T, j = rem - i * p.T;
  const int64_t n = clamp_nodes(p.num_nodes[b], p.T);
  const int64_t* par = p.parents + b * p.T;
  bool m;
  if (i >= n)
    m = (i == j);  // padding rows see only themselves
  else
    m = (j <= i) && is_ancestor_or_self(par, i, j);
  p.tree_mask[idx] = m;
  if (j != 0) return;
  const int64_t o = b * p.T + i;
  int64_t L = p.prefix_lens[b];
  L = L < 0 ? 0 : L;
  if (i >= n) {
    p.positions[o] = L;
    p.first_child[o] = -1;
    p.next_sibling[o] = -1;
    return;
  }
  int64_t depth = 0;
  for (int64_t cur = i; cur > 0; ++depth) {
    const int64_t q = par[cur];
    if (q < 0 || q >= cur) break;
    cur = q;
  }
  p.positions[o] = L + depth;
  int64_t fc = -1, ns = -1;
  for (int64_t q = i + 1; q < n; ++q)
    if (par[q] == i) {
      fc = q;
      break;
    }
  if (i > 0) {
    const int64_t pi = par[i];
    for (int64_t q = i + 1; q < n; ++q)
      if (par[q] == pi) {
        ns = q;
        break;
      }
  }
  p.first_child[o] = fc;
  p.next_sibling[o] = ns;
}

template <class Launch>
void build_tree_run(const BuildTreeParams& p, Launch&& launch) {
  const int64_t total = p.B * p.T * p.T;
  if (total == 0) return;
  constexpr int NT = 256;
  launch(build_tree_kernel, dim3(static_cast<unsigned>(ceil_div(total, NT))), dim3(NT), size_t{0}, p);
}

// =============================================================================================
// Byte fills of a block-owned range with 16-byte stores in the aligned middle.
// =============================================================================================
template <int NT>
HS_DEV void block_fill_ones(unsigned char* p0, unsigned char* p1) {
  if (p1 <= p0) return;
  const int tid = threadIdx.x;
  const uintptr_t a0 = (reinterpret_cast<uintptr_t>(p0) + 15) & ~static_cast<uintptr_t>(15);
  const uintptr_t a1 = reinterpret_cast<uintptr_t>(p1) & ~static_cast<uintptr_t>(15);
  if (a0 >= a1) {
    for (int64_t t = tid; t < p1 - p0; t += NT) p0[t] = 1;
    return;
  }
  unsigned char* q0 = reinterpret_cast<unsigned char*>(a0);
  unsigned char* q1 = reinterpret_cast<unsigned char*>(a1);
  for (int64_t t = tid; t < q0 - p0; t += NT) p0[t] = 1;
  const uint4 ones = make_uint4(0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u);
  uint4* v = reinterpret_cast<uint4*>(q0);
  const int64_t nv = (q1 - q0) / 16;
  for (int64_t t = tid; t < nv; t += NT) v[t] = ones;
  for (int64_t t = tid; t < p1 - q1; t += NT) q1[t] = 1;
}

// =============================================================================================
// tree_attention_mask: one block per (tree row i, request b); grid = (T, B).
//   tree_mask [B, T, T] bool, num_nodes / prefix_lens [B] int64 (contiguous);
//   custom_mask [mask_numel] bool: per request the row-major [n_b, L_b + n_b] block;
//   mask_indptr [B + 1] int64.
// Each block derives its request's offset with a block reduction over the earlier requests; the
// i == 0 block of request b writes mask_indptr[b + 1]. Writes are clipped to [0, mask_numel):
// a wrong mask_numel is caught by the CPU op; on CUDA compare mask_indptr[-1] with it.
// =============================================================================================
struct TreeAttnMaskParams {
  const bool* tree_mask;
  const int64_t* num_nodes;
  const int64_t* prefix_lens;
  int64_t B, T, mask_numel;
  bool* custom_mask;
  int64_t* mask_indptr;
};

HS_HD int64_t tree_mask_block_numel(int64_t n, int64_t L, int64_t T) {
  n = clamp_nodes(n, T);
  L = L < 0 ? 0 : L;
  return n * (L + n);
}

template <int NT>
__global__ void __launch_bounds__(NT) tree_attention_mask_kernel(TreeAttnMaskParams p) {
  __shared__ int64_t red[33];
  const int64_t i = blockIdx.x, b = blockIdx.y;
  const int tid = threadIdx.x;
  int64_t part = 0;
  for (int64_t q = tid; q < b; q += NT) part += tree_mask_block_numel(p.num_nodes[q], p.prefix_lens[q], p.T);
  const int64_t off = block_sum(part, red);
  const int64_t n = clamp_nodes(p.num_nodes[b], p.T);
  int64_t L = p.prefix_lens[b];
  L = L < 0 ? 0 : L;
  if (i == 0 && tid == 0) {
    p.mask_indptr[b + 1] = off + n * (L + n);
    if (b == 0) p.mask_indptr[0] = 0;
  }
  if (i >= n) return;
  const int64_t W = L + n;
  const int64_t r0 = off + i * W;  // row start
  const int64_t lim = p.mask_numel;
  unsigned char* out = reinterpret_cast<unsigned char*>(p.custom_mask);
  // prefix columns [0, L)
  const int64_t pb = r0 < lim ? r0 : lim, pe = (r0 + L) < lim ? (r0 + L) : lim;
  block_fill_ones<NT>(out + pb, out + pe);
  // tree columns [L, L + n)
  const bool* src = p.tree_mask + (b * p.T + i) * p.T;
  for (int64_t j = tid; j < n; j += NT) {
    const int64_t d = r0 + L + j;
    if (d < lim) p.custom_mask[d] = src[j];
  }
}

template <class Launch>
void tree_attention_mask_run(const TreeAttnMaskParams& p, Launch&& launch) {
  if (p.B == 0 || p.T == 0) return;
  constexpr int NT = 256;
  launch(tree_attention_mask_kernel<NT>, dim3(static_cast<unsigned>(p.T), static_cast<unsigned>(p.B)), dim3(NT),
         size_t{0}, p);
}

// =============================================================================================
// dense_tree_attention_mask: one block per output row (i, b); grid = (T, B). Each thread builds
// 16 consecutive bytes of the row and stores them with one 16-byte store when aligned.
//   tree_mask [B, T, T] bool, prefix_lens [B] int64; out [B, T, width] bool.
// Row (b, i): column c < L_b -> true; L_b <= c < L_b + T -> tree_mask[b, i, c - L_b]; else false.
// =============================================================================================
struct DenseMaskParams {
  const bool* tree_mask;
  const int64_t* prefix_lens;
  int64_t B, T, width;
  bool* out;
};

template <int NT>
__global__ void __launch_bounds__(NT) dense_tree_attention_mask_kernel(DenseMaskParams p) {
  const int64_t i = blockIdx.x, b = blockIdx.y;
  int64_t L = p.prefix_lens[b];
  L = L < 0 ? 0 : L;
  const bool* src = p.tree_mask + (b * p.T + i) * p.T;
  unsigned char* row = reinterpret_cast<unsigned char*>(p.out) + (b * p.T + i) * p.width;
  const int64_t nchunks = ceil_div(p.width, 16);
  for (int64_t q = threadIdx.x; q < nchunks; q += NT) {
    const int64_t c0 = q * 16;
    uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const int64_t c = c0 + e;
      uint32_t v = 0;
      if (c < L)
        v = 1;
      else if (c - L < p.T)
        v = src[c - L] ? 1u : 0u;
      w[e / 4] |= v << (8 * (e % 4));
    }
    unsigned char* dst = row + c0;
    if (c0 + 16 <= p.width && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      for (int e = 0; e < 16 && c0 + e < p.width; ++e) dst[e] = static_cast<unsigned char>((w[e / 4] >> (8 * (e % 4))) & 1u);
    }
  }
}

template <class Launch>
void dense_tree_attention_mask_run(const DenseMaskParams& p, Launch&& launch) {
  if (p.B == 0 || p.T == 0 || p.width == 0) return;
  constexpr int NT = 128;
  launch(dense_tree_attention_mask_kernel<NT>, dim3(static_cast<unsigned>(p.T), static_cast<unsigned>(p.B)),
         dim3(NT), size_t{0}, p);
}

}  // namespace cuda
}  // namespace heterospec
