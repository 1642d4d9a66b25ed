// The CPU engine's persistent worker pool: threads are started once (at the first parallel
// loop that needs them) and joined when the pool is destroyed with its engine, instead of per
// loop. Tasks are claimed dynamically, but every task writes only its own outputs with a fixed
// arithmetic order, so results do not depend on which worker runs which task or on the number
// of workers (bitwise determinism).
//
// Starting the threads is the pool's only allocation; a parallel loop allocates nothing.
//
// One pool serves concurrent callers (a handle is shared by many threads): each parallel loop
// is a job in a queue; pool threads join jobs up to the job's worker count, each taking a slot
// in [0, workers) that indexes the call's per-worker scratch; the calling thread is slot 0 and
// runs tasks too, so a loop completes even when no pool thread is free.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "util/function_ref.hpp"

namespace moeblaze {
inline namespace v0 {

class ThreadPool {
 public:
  // workers >= 1 (the caller included): workers - 1 pool threads at most.
  explicit ThreadPool(int workers);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int workers() const { return workers_; }

  // Runs fn(task, slot) for task in [0, num_tasks) on up to workers() threads; slot <
  // workers() is unique among the threads running this call. Exceptions thrown by fn are
  // rethrown on the calling thread after every thread has left the loop. Thread-safe.
  void parallel_for(int64_t num_tasks, FunctionRef<void(int64_t task, int slot)> fn) const;

 private:
  struct Job;
  void start_threads() const;
  void worker_loop() const;
  void unlink(Job* job) const;  // takes a job off the queue (mutex_ held); no-op if it is off

  int workers_;
  mutable std::once_flag started_;
  mutable std::mutex mutex_;
  mutable std::condition_variable work_;  // a job was queued, or stop
  mutable std::condition_variable done_;  // a job's last joined thread left it
  // Jobs open to more threads, oldest first: an intrusive list through the jobs themselves
  // (which live on their callers' stacks), so queueing a loop allocates nothing.
  mutable Job* queue_head_ = nullptr;
  mutable Job* queue_tail_ = nullptr;
  mutable std::vector<std::thread> threads_;
  mutable bool stop_ = false;
};

int hardware_threads();

}  // namespace v0
}  // namespace moeblaze
