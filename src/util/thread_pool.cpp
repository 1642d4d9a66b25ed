#include "util/thread_pool.hpp"

#include <algorithm>
#include <atomic>
#include <exception>

namespace moeblaze {
inline namespace v0 {

int hardware_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

struct ThreadPool::Job {
  FunctionRef<void(int64_t, int)> fn;
  Job* prev = nullptr;  // the pool's queue of open jobs
  Job* next_job = nullptr;
  bool queued = false;
  Job(FunctionRef<void(int64_t, int)> f, int64_t n, int slots) : fn(f), num_tasks(n), max_slots(slots) {}
  int64_t num_tasks;
  int max_slots;
  std::atomic<int64_t> next{0};
  int slots_taken = 1;  // slot 0 is the caller's; guarded by the pool's mutex
  int active = 0;       // pool threads inside this job; guarded by the pool's mutex
  std::mutex error_mutex;
  std::exception_ptr error;

  void run(int slot) {
    try {
      for (int64_t t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) fn(t, slot);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      next.store(num_tasks);  // stop handing out work
    }
  }
};

ThreadPool::ThreadPool(int workers) : workers_(std::max(workers, 1)) {}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ThreadPool::start_threads() const {
  threads_.reserve(static_cast<size_t>(workers_ - 1));
  try {
    for (int i = 1; i < workers_; ++i) threads_.emplace_back([this] { worker_loop(); });
  } catch (...) {
    // Fewer threads than asked: the callers still run every task themselves.
  }
}

void ThreadPool::worker_loop() const {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_.wait(lock, [this] { return stop_ || queue_head_; });
    if (!queue_head_) return;  // stop_ and nothing left
    Job* job = queue_head_;
    const int slot = job->slots_taken++;
    if (job->slots_taken >= job->max_slots) unlink(job);  // full: nobody else joins
    ++job->active;
    lock.unlock();
    job->run(slot);
    lock.lock();
    if (--job->active == 0) done_.notify_all();
  }
}

void ThreadPool::unlink(Job* job) const {
  if (!job->queued) return;
  (job->prev ? job->prev->next_job : queue_head_) = job->next_job;
  (job->next_job ? job->next_job->prev : queue_tail_) = job->prev;
  job->prev = job->next_job = nullptr;
  job->queued = false;
}

void ThreadPool::parallel_for(int64_t num_tasks, FunctionRef<void(int64_t, int)> fn) const {
  if (num_tasks <= 0) return;
  const int workers = static_cast<int>(std::min<int64_t>(workers_, num_tasks));
  if (workers == 1) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(t, 0);
    return;
  }
  std::call_once(started_, [this] { start_threads(); });
  Job job(fn, num_tasks, workers);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job.prev = queue_tail_;
    (queue_tail_ ? queue_tail_->next_job : queue_head_) = &job;
    queue_tail_ = &job;
    job.queued = true;
  }
  work_.notify_all();
  job.run(0);
  {
    std::unique_lock<std::mutex> lock(mutex_);
    unlink(&job);  // no thread joins from here on
    done_.wait(lock, [&] { return job.active == 0; });
  }
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace v0
}  // namespace moeblaze
