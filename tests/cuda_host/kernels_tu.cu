// Torch-free translation unit that instantiates every heterospec CUDA kernel exactly as the
// launchers do (through the *_run schedules with a real stream launcher). Used for a fast
// compile check and for resource usage:
//   nvcc -c -O3 -arch=sm_90 -Xptxas -v -I csrc tests/cuda_host/kernels_tu.cu -o /tmp/k.o
#include "cuda/kernels/bin_policy.cuh"
#include "cuda/kernels/kv.cuh"
#include "cuda/kernels/topk_entropy.cuh"
#include "cuda/kernels/tree.cuh"
#include "cuda/kernels/verify.cuh"

namespace hc = heterospec::cuda;

void instantiate_all(cudaStream_t s) {
  hc::StreamLauncher L{s};
  hc::TopkParams tp{};
  hc::topk_entropy_run<float>(tp, true, nullptr, L);
  hc::topk_entropy_run<__half>(tp, true, nullptr, L);
  hc::topk_entropy_run<__nv_bfloat16>(tp, true, nullptr, L);
  hc::entropy_bin_policy_run(hc::BinPolicyParams{}, L);
  hc::select_tree_nodes_run(hc::SelectParams{}, L);
  hc::build_tree_run(hc::BuildTreeParams{}, L);
  hc::tree_attention_mask_run(hc::TreeAttnMaskParams{}, L);
  hc::dense_tree_attention_mask_run(hc::DenseMaskParams{}, L);
  hc::verify_greedy_run(hc::VerifyGreedyParams{}, L);
  hc::verify_sampling_run(hc::VerifySamplingParams{}, true, L);
  hc::compact_kv_run(hc::CompactKvParams{}, 16, 1024, L);
}
