// A small SIMT emulator that runs heterospec's CUDA kernels (csrc/cuda/kernels/*.cuh) on the host,
// so their logic can be tested on machines without a GPU (g++ -std=c++20, Linux / glibc).
//
// Model: blocks run one after another; every CUDA thread of a block is a cooperative fiber
// on the calling OS thread (started with makecontext / swapcontext, then switched with
// _setjmp / _longjmp, which costs no system call). A fiber runs until it reaches a
// synchronisation point, then the next one runs:
//   * __shared__ variables become function-local `static` objects: shared by the threads of the
//     running block (blocks never overlap), as on the device.
//   * __syncthreads / _or / _count / _and: a barrier over the block's live threads (a finished
//     thread drops out, like an exited CUDA thread).
//   * warp shuffles / __syncwarp: exchange slots between two warp barriers (all 32 lanes must
//     take part, as with mask 0xffffffff on the device).
//   * atomics: plain read-modify-write (one OS thread); __ldg: a plain load; fast intrinsics:
//     their libm versions (no __CUDA_ARCH__).
// It checks logic (indexing, barrier structure, reductions, tie-breaking, bounds), not timing,
// memory coalescing or the exact rounding of hardware approximations. A missing barrier shows up
// only when the round-robin order happens to expose it.
#pragma once

// Fibers switch with _setjmp/_longjmp between stacks; glibc's fortified longjmp would reject that.
#undef _FORTIFY_SOURCE
#define _FORTIFY_SOURCE 0

#include <csetjmp>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>  // dim3, uint4, float4, make_uint4, ... (host definitions)
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>

// ---- CUDA keywords as host C++ --------------------------------------------------------------
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline
#define __launch_bounds__(...)

namespace emu {

constexpr size_t kStackBytes = 64 * 1024;

struct Fiber {
  ucontext_t ctx;   // initial context (first run)
  jmp_buf env;      // where it yielded
  char* stack = nullptr;
  dim3 thread_idx;
  int tid = 0;
  bool started = false, done = false;
};

struct Barrier {
  int live = 0, arrived = 0;
  uint64_t gen = 0;
};

struct Block {
  std::vector<Fiber> fibers;
  Barrier block_bar;
  std::vector<Barrier> warp_bars;
  std::vector<uint64_t> slots;  // shuffle exchange, one 8-byte slot per thread
  std::vector<unsigned char> dyn_smem;
  int red_pending = 0, red_result = 0;
  dim3 block_idx;
  ucontext_t sched;  // scheduler context saved when a fiber is first started
  jmp_buf sched_env;  // scheduler resume point
  std::function<void()> body;
};

inline Block* g_block = nullptr;
inline Fiber* g_cur = nullptr;
inline dim3 g_grid_dim, g_block_dim;

inline unsigned char* dynamic_smem() { return g_block->dyn_smem.data(); }
inline int flat_tid() { return g_cur->tid; }

inline void yield() {
  if (!_setjmp(g_cur->env)) _longjmp(g_block->sched_env, 1);
}

// Arrive at `b` and wait until every live participant has arrived.
inline void barrier_wait(Barrier& b, bool block_level) {
  const uint64_t gen = b.gen;
  if (++b.arrived == b.live) {
    b.arrived = 0;
    ++b.gen;
    if (block_level) {
      g_block->red_result = g_block->red_pending;
      g_block->red_pending = 0;
    }
    return;
  }
  while (b.gen == gen) yield();
}

inline void barrier_drop(Barrier& b, bool block_level) {  // a participant finished
  --b.live;
  if (b.arrived > 0 && b.arrived == b.live) {
    b.arrived = 0;
    ++b.gen;
    if (block_level) {
      g_block->red_result = g_block->red_pending;
      g_block->red_pending = 0;
    }
  }
}

[[noreturn]] inline void fiber_entry() {
  g_block->body();
  g_cur->done = true;
  barrier_drop(g_block->warp_bars[g_cur->tid / 32], false);
  barrier_drop(g_block->block_bar, true);
  _longjmp(g_block->sched_env, 1);  // never returns into the (stale) start context
}

// Runs `kernel(args...)` over the grid, block after block.
template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, Args... args) {
  const int n = static_cast<int>(block.x * block.y * block.z);
  if (n <= 0 || n > 1024) throw std::runtime_error("emu::launch: bad block size");
  g_grid_dim = grid;
  g_block_dim = block;
  std::vector<char> stacks(static_cast<size_t>(n) * kStackBytes);  // reused by every block
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block blk;
        blk.block_idx = dim3(bx, by, bz);
        blk.dyn_smem.assign(smem + 16, 0xCD);  // poisoned, like uninitialised shared memory
        blk.slots.assign(n, 0);
        blk.block_bar.live = n;
        for (int w = 0; w < (n + 31) / 32; ++w) {
          Barrier wb;
          wb.live = std::min(32, n - 32 * w);
          blk.warp_bars.push_back(wb);
        }
        blk.body = [&] { kernel(args...); };
        blk.fibers.resize(n);
        g_block = &blk;
        for (int t = 0; t < n; ++t) {
          Fiber& f = blk.fibers[t];
          f.tid = t;
          f.thread_idx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
          f.stack = stacks.data() + static_cast<size_t>(t) * kStackBytes;
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack;
          f.ctx.uc_stack.ss_size = kStackBytes;
          f.ctx.uc_link = &blk.sched;
          makecontext(&f.ctx, fiber_entry, 0);
        }
        int remaining = n;
        while (remaining > 0) {
          for (auto& f : blk.fibers) {
            if (f.done) continue;
            g_cur = &f;
            if (!_setjmp(blk.sched_env)) {
              if (!f.started) {
                f.started = true;
                swapcontext(&blk.sched, &f.ctx);
              } else {
                _longjmp(f.env, 1);
              }
            }
            if (f.done) --remaining;
          }
        }
        g_cur = nullptr;
        g_block = nullptr;
      }
}

inline void syncwarp() { barrier_wait(g_block->warp_bars[flat_tid() / 32], false); }

template <class T>
T shfl_impl(T v, int src_lane_in_warp) {
  static_assert(sizeof(T) <= 8, "shuffle of a type > 8 bytes");
  const int tid = flat_tid();
  uint64_t raw = 0;
  std::memcpy(&raw, &v, sizeof(T));
  g_block->slots[tid] = raw;
  syncwarp();
  T out;
  const uint64_t r = g_block->slots[(tid / 32) * 32 + src_lane_in_warp];
  std::memcpy(&out, &r, sizeof(T));
  syncwarp();
  return out;
}

}  // namespace emu

#define threadIdx (::emu::g_cur->thread_idx)
#define blockIdx (::emu::g_block->block_idx)
#define blockDim (::emu::g_block_dim)
#define gridDim (::emu::g_grid_dim)
#define HS_EXTERN_SMEM(name) unsigned char* name = ::emu::dynamic_smem()

inline void __syncthreads() { emu::barrier_wait(emu::g_block->block_bar, true); }
inline int __syncthreads_count(int p) {
  if (p) ++emu::g_block->red_pending;
  emu::barrier_wait(emu::g_block->block_bar, true);
  return emu::g_block->red_result;  // stable until every thread reaches the next barrier
}
inline int __syncthreads_or(int p) { return __syncthreads_count(p != 0) > 0 ? 1 : 0; }
inline int __syncthreads_and(int p) { return __syncthreads_count(p == 0) == 0 ? 1 : 0; }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::syncwarp(); }

template <class T>
T __shfl_sync(unsigned, T v, int src, int width = 32) {
  (void)width;
  return emu::shfl_impl(v, src & 31);
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int m, int width = 32) {
  (void)width;
  return emu::shfl_impl(v, (emu::flat_tid() & 31) ^ m);
}
template <class T>
T __shfl_up_sync(unsigned, T v, unsigned d, int width = 32) {
  (void)width;
  const int lane = emu::flat_tid() & 31;
  return emu::shfl_impl(v, lane >= static_cast<int>(d) ? lane - static_cast<int>(d) : lane);
}
template <class T>
T __shfl_down_sync(unsigned, T v, unsigned d, int width = 32) {
  (void)width;
  const int lane = emu::flat_tid() & 31;
  return emu::shfl_impl(v, lane + static_cast<int>(d) < 32 ? lane + static_cast<int>(d) : lane);
}

template <class T>
T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
template <class T>
T __ldg(const T* p) {
  return *p;
}
