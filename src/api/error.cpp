// Thread-local last-error message and the process-wide log callback.
#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>

#include "api/guard.hpp"

namespace moeblaze {
inline namespace v0 {
namespace api {
namespace {

thread_local std::string t_last_error;

struct LogSink {
  std::mutex mutex;
  moeblaze_log_fn fn = nullptr;
  void* user_data = nullptr;
  int32_t min_level = 0;
};
LogSink& sink() {
  static LogSink s;
  return s;
}

}  // namespace

void log_message(int32_t level, const char* func, const char* message) {
  LogSink& s = sink();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.fn && level <= s.min_level) s.fn(s.user_data, level, func, message);
}

void set_last_error(const char* func, moeblaze_status_t status, const char* message) {
  try {
    t_last_error = std::string(func) + ": " + message;
  } catch (...) {
    t_last_error.clear();  // out of memory while reporting: keep the status, drop the text
  }
  (void)status;
  log_message(MOEBLAZE_LOG_ERROR, func, t_last_error.c_str());
}

void clear_last_error() { t_last_error.clear(); }

const char* last_error() { return t_last_error.c_str(); }

void set_log_callback(moeblaze_log_fn fn, void* user_data, int32_t min_level) {
  LogSink& s = sink();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.fn = fn;
  s.user_data = user_data;
  s.min_level = min_level;
}

}  // namespace api
}  // namespace v0
}  // namespace moeblaze
