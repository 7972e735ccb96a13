// Torch-free device helpers shared by heterospec's CUDA kernels: warp / block reductions and
// scans, the (value desc, id asc) ordering used by every top-k, fast exp2, dtype conversion and
// 16-byte vector loads.
//
// Conventions of every kernel that uses these helpers:
//   * blockDim.x is a multiple of 32 and every thread of the block reaches every block-wide helper
//     (they contain __syncthreads); "scratch" arguments are __shared__ arrays of >= 33 entries.
//   * Only full-warp shuffles (mask 0xffffffff) with all 32 lanes converged.
// The same headers compile with g++ for the host-side SIMT emulator (tests/cuda_host/), which
// defines HS_EXTERN_SMEM itself and has no __CUDA_ARCH__.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#define HS_HD __host__ __device__ __forceinline__
#define HS_DEV __device__ __forceinline__

// Dynamic shared memory of a kernel as `unsigned char* name` (16-byte aligned).
#ifndef HS_EXTERN_SMEM
#define HS_EXTERN_SMEM(name)                                  \
  extern __shared__ __align__(16) unsigned char name##_raw[]; \
  unsigned char* name = name##_raw
#endif

namespace heterospec {
namespace cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

HS_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

HS_HD float pos_inf() { return INFINITY; }
HS_HD float neg_inf() { return -INFINITY; }
HS_HD bool is_nan(float x) { return x != x; }

// ---- ordering of (value, id) pairs: larger value first, ties by the lower id ----------------
// NaN never "beats" anything and is never beaten in a way that matters: callers exclude NaN.
HS_HD bool beats(float av, int ai, float bv, int bi) { return av > bv || (av == bv && ai < bi); }

// Monotone map of a float to uint32 (a < b  <=>  key(a) < key(b)); -0.0 and +0.0 map to the same
// key (they compare equal as floats). NaN must be excluded by the caller.
HS_HD uint32_t float_order_key(float f) {
  if (f == 0.0f) f = 0.0f;  // canonical +0
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// exp2 with the hardware approximation on the device (rel. error ~2^-22, -inf -> +0).
HS_DEV float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// ---- dtype conversion and 16-byte vector loads -----------------------------------------------
HS_HD float to_float(float x) { return x; }
HS_HD float to_float(__half x) { return __half2float(x); }
HS_HD float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Loads VEC consecutive elements of T starting at p (16-byte aligned when VEC * sizeof(T) == 16)
// and converts them to float.
template <typename T, int VEC>
HS_DEV void load_as_float(const T* p, float* out) {
  if constexpr (VEC * sizeof(T) == 16) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    T tmp[VEC];
    memcpy(tmp, &u, 16);
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = to_float(tmp[e]);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = to_float(p[e]);
  }
}

// ---- warp-level reductions / scans ------------------------------------------------------------
template <typename T>
HS_DEV T warp_sum(T v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

template <typename T>
HS_DEV T warp_max(T v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) {
    const T w = __shfl_xor_sync(kFullMask, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// Best (value, id) pair of the warp under `beats`; every lane gets the result.
HS_DEV void warp_best(float& v, int& id) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, v, o);
    const int oi = __shfl_xor_sync(kFullMask, id, o);
    if (beats(ov, oi, v, id)) {
      v = ov;
      id = oi;
    }
  }
}

// Inclusive prefix sum over the lanes of a warp.
template <typename T>
HS_DEV T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x & (kWarpSize - 1);
#pragma unroll
  for (int o = 1; o < kWarpSize; o <<= 1) {
    const T w = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += w;
  }
  return v;
}

// ---- block-level reductions / scans (all threads must call; `scratch` has >= 33 entries) -----
template <typename T>
HS_DEV T block_sum(T v, T* scratch) {
  const int lane = threadIdx.x & (kWarpSize - 1), warp = threadIdx.x / kWarpSize;
  const int nwarps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = lane < nwarps ? scratch[lane] : T(0);
    w = warp_sum(w);
    if (lane == 0) scratch[32] = w;
  }
  __syncthreads();
  const T r = scratch[32];
  __syncthreads();  // scratch may be reused right away
  return r;
}

template <typename T>
HS_DEV T block_max(T v, T lowest, T* scratch) {
  const int lane = threadIdx.x & (kWarpSize - 1), warp = threadIdx.x / kWarpSize;
  const int nwarps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = lane < nwarps ? scratch[lane] : lowest;
    w = warp_max(w);
    if (lane == 0) scratch[32] = w;
  }
  __syncthreads();
  const T r = scratch[32];
  __syncthreads();
  return r;
}

template <typename T>
HS_DEV T block_min(T v, T highest, T* scratch) {
  return -block_max<T>(-v, -highest, scratch);
}

// Exclusive prefix sum over the threads of the block, in thread order; `*total` gets the sum.
template <typename T>
HS_DEV T block_exclusive_scan(T v, T* scratch, T* total) {
  const int lane = threadIdx.x & (kWarpSize - 1), warp = threadIdx.x / kWarpSize;
  const int nwarps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  const T inc = warp_inclusive_scan(v);
  if (lane == kWarpSize - 1) scratch[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const T w = lane < nwarps ? scratch[lane] : T(0);
    const T winc = warp_inclusive_scan(w);
    scratch[lane] = winc - w;  // exclusive prefix of warp totals
    if (lane == kWarpSize - 1) scratch[32] = winc;
  }
  __syncthreads();
  const T r = scratch[warp] + (inc - v);
  *total = scratch[32];
  __syncthreads();
  return r;
}

// ---- launching --------------------------------------------------------------------------------
// Every op's host schedule (`*_run` in kernels/*.cuh) launches through a callable
// `launch(kernel, grid, block, smem_bytes, args...)`: this one on a CUDA stream (the launchers
// pass the current torch stream and check `error` afterwards), the host emulator's on threads.
#if defined(__CUDACC__)
struct StreamLauncher {
  cudaStream_t stream;
  cudaError_t error = cudaSuccess;  // first launch error, if any

  template <class Kernel, class... Args>
  void operator()(Kernel kernel, dim3 grid, dim3 block, size_t smem, Args... args) {
    kernel<<<grid, block, smem, stream>>>(args...);
    const cudaError_t e = cudaGetLastError();
    if (error == cudaSuccess) error = e;
  }
};
#endif

}  // namespace cuda
}  // namespace heterospec
