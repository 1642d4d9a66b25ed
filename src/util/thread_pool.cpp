#include "util/thread_pool.hpp"

#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {

int hardware_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

void parallel_for(int64_t num_tasks, int num_workers,
                  const std::function<void(int64_t, int)>& fn) {
  if (num_tasks <= 0) return;
  int workers = static_cast<int>(std::min<int64_t>(num_workers < 1 ? 1 : num_workers, num_tasks));
  if (workers == 1) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(t, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr first_error;
  std::mutex error_mutex;
  auto run = [&](int worker) {
    try {
      for (int64_t t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) fn(t, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!first_error) first_error = std::current_exception();
      next.store(num_tasks);  // stop handing out work
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(workers - 1);
  try {
    for (int w = 1; w < workers; ++w) threads.emplace_back(run, w);
  } catch (...) {
    // Could not start every thread: the ones started plus the caller still finish the work.
  }
  run(0);
  for (auto& th : threads) th.join();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace v0
}  // namespace moeblaze
