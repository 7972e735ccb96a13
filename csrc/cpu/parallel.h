// Grain sizes for at::parallel_for in the CPU kernels. Small problems (the common case: a few
// requests, trees of tens of nodes, 20-200 us of work) must stay on one thread: waking OpenMP
// workers costs more than they save, and on a busy machine a descheduled worker stalls the whole
// region for a scheduler time slice (measured: 20 us -> 8-16 ms with 2 threads on a loaded 2-core
// box). So a task is about 1M element reads / writes (~0.3-1 ms), far above ATen's 32768.
#pragma once

#include <algorithm>
#include <cstdint>

namespace heterospec {

constexpr int64_t kGrainWork = int64_t{1} << 20;

// Items per task when each item costs `work_per_item` element accesses.
inline int64_t grain_for(int64_t work_per_item, int64_t grain_work = kGrainWork) {
  return std::max<int64_t>(1, grain_work / std::max<int64_t>(1, work_per_item));
}

}  // namespace heterospec
