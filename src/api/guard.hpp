// The exception barrier of every extern "C" entry point: no C++ exception crosses the C
// boundary. Maps moeblaze::Error to its status, std::bad_alloc to OUT_OF_HOST_MEMORY and
// anything else to INTERNAL_ERROR, and records the thread-local message (and logs it).
#pragma once

#include <exception>
#include <new>

#include "moeblaze/moeblaze.h"
#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {
namespace api {

void set_last_error(const char* func, moeblaze_status_t status, const char* message);
void clear_last_error();
void log_message(int32_t level, const char* func, const char* message);

template <class F>
moeblaze_status_t guard(const char* func, F&& body) noexcept {
  try {
    body();
    clear_last_error();
    return MOEBLAZE_STATUS_SUCCESS;
  } catch (const Error& e) {
    set_last_error(func, static_cast<moeblaze_status_t>(e.status()), e.what());
    return static_cast<moeblaze_status_t>(e.status());
  } catch (const std::bad_alloc&) {
    set_last_error(func, MOEBLAZE_STATUS_OUT_OF_HOST_MEMORY, "host memory allocation failed");
    return MOEBLAZE_STATUS_OUT_OF_HOST_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(func, MOEBLAZE_STATUS_INTERNAL_ERROR, e.what());
    return MOEBLAZE_STATUS_INTERNAL_ERROR;
  } catch (...) {
    set_last_error(func, MOEBLAZE_STATUS_INTERNAL_ERROR, "unknown internal exception");
    return MOEBLAZE_STATUS_INTERNAL_ERROR;
  }
}

}  // namespace api
}  // namespace v0
}  // namespace moeblaze
