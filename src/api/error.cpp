// Thread-local last-error message and the process-wide log callback.
//
// The callback runs outside the sink's lock, so it may call any library function, from any
// thread: set_log_callback (to uninstall or replace itself) and calls that fail included.
// Messages raised on a thread while that thread is inside the callback are not delivered to
// it (they would recurse); they still set that call's last-error message. Replacing the
// callback from outside a callback waits until no other thread is running the previous one,
// so its user_data may be freed as soon as set_log_callback returns.
#include <condition_variable>
#include <mutex>
#include <string>

#include "api/guard.hpp"

namespace moeblaze {
inline namespace v0 {
namespace api {
namespace {

thread_local std::string t_last_error;
thread_local int t_in_callback = 0;  // callbacks of this thread now running (0 or 1)

struct LogSink {
  std::mutex mutex;
  std::condition_variable idle;
  moeblaze_log_fn fn = nullptr;
  void* user_data = nullptr;
  int32_t min_level = 0;
  int64_t running = 0;  // callbacks running now, over all threads
};
LogSink& sink() {
  static LogSink s;
  return s;
}

}  // namespace

void log_message(int32_t level, const char* func, const char* message) {
  if (t_in_callback) return;
  LogSink& s = sink();
  moeblaze_log_fn fn;
  void* user_data;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.fn || level > s.min_level) return;
    fn = s.fn;
    user_data = s.user_data;
    ++s.running;
  }
  t_in_callback = 1;
  fn(user_data, level, func, message);
  t_in_callback = 0;
  std::lock_guard<std::mutex> lock(s.mutex);
  if (--s.running == 0) s.idle.notify_all();
}

void set_last_error(const char* func, moeblaze_status_t status, const char* message) {
  (void)status;
  std::string text;
  try {
    text = std::string(func) + ": " + message;
  } catch (...) {
    t_last_error.clear();  // out of memory while reporting: keep the status, drop the text
    return;
  }
  t_last_error = text;
  // The callback gets its own copy: a call it makes on this thread replaces t_last_error. The
  // failing call's message is restored afterwards.
  log_message(MOEBLAZE_LOG_ERROR, func, text.c_str());
  t_last_error.swap(text);
}

void clear_last_error() { t_last_error.clear(); }

const char* last_error() { return t_last_error.c_str(); }

void set_log_callback(moeblaze_log_fn fn, void* user_data, int32_t min_level) {
  LogSink& s = sink();
  std::unique_lock<std::mutex> lock(s.mutex);
  s.fn = fn;
  s.user_data = user_data;
  s.min_level = min_level;
  // From inside a callback, waiting for the others could wait on a thread that waits for this
  // one; the caller's own callback is still running in any case. Return at once there.
  if (!t_in_callback) s.idle.wait(lock, [&] { return s.running == 0; });
}

}  // namespace api
}  // namespace v0
}  // namespace moeblaze
