// entropy_bin_policy on CUDA (docs/design.md, op 3): one thread per request.
//
// Layouts: path_entropy [B] float32; bin_edges [nb - 1] float32 ascending; bin_extra_depth,
// bin_budget [nb] int64; outputs bins, extra_depth, budget [B] int64 (all contiguous).
// bins[b] = #edges e with path_entropy[b] > e (== lower_bound for ascending edges, as the CPU
// op); NaN entropy -> the last bin. Edge order / NaN edges are validated only on the CPU (a
// data-dependent check would need a device sync); here the count is used as is.
#pragma once

#include "../common.cuh"

namespace heterospec {
namespace cuda {

struct BinPolicyParams {
  const float* path_entropy;
  const float* edges;
  const int64_t* extra_depth_table;
  const int64_t* budget_table;
  int64_t B, num_edges;
  int64_t* bins;
  int64_t* extra_depth;
  int64_t* budget;
};

HS_HD int64_t entropy_bin_of(float h, const float* edges, int64_t num_edges) {
  if (is_nan(h)) return num_edges;  // last bin
  int64_t bin = 0;
  for (int64_t j = 0; j < num_edges; ++j) bin += (h > edges[j]) ? 1 : 0;
  return bin;
}

__global__ void entropy_bin_policy_kernel(BinPolicyParams p) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= p.B) return;
  const int64_t bin = entropy_bin_of(p.path_entropy[b], p.edges, p.num_edges);
  p.bins[b] = bin;
  p.extra_depth[b] = p.extra_depth_table[bin];
  p.budget[b] = p.budget_table[bin];
}

template <class Launch>
void entropy_bin_policy_run(const BinPolicyParams& p, Launch&& launch) {
  if (p.B == 0) return;
  constexpr int NT = 128;
  launch(entropy_bin_policy_kernel, dim3(static_cast<unsigned>(ceil_div(p.B, NT))), dim3(NT), size_t{0}, p);
}

}  // namespace cuda
}  // namespace heterospec
