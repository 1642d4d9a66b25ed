// Fork-join parallel loop for the CPU engine. Tasks are claimed dynamically, but every task
// writes only its own outputs with a fixed arithmetic order, so results do not depend on
// which worker runs which task or on the number of workers (bitwise determinism).
#pragma once

#include <cstdint>
#include <functional>

namespace moeblaze {
inline namespace v0 {

// Runs fn(task, worker) for task in [0, num_tasks) on up to num_workers threads (the caller
// is worker 0). worker < num_workers indexes per-worker scratch. Exceptions thrown by fn are
// rethrown on the calling thread after all workers have joined.
void parallel_for(int64_t num_tasks, int num_workers,
                  const std::function<void(int64_t task, int worker)>& fn);

int hardware_threads();

}  // namespace v0
}  // namespace moeblaze
