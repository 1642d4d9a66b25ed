// Internal error type: thrown inside the library, caught at the C boundary (src/api/guard)
// and turned into a status plus the thread-local message. Never escapes the library.
#pragma once

#include <cstdint>
#include <exception>
#include <string>

namespace moeblaze {
inline namespace v0 {

// Values equal the public moeblaze_status_t (checked by static_asserts in src/api).
enum class Status : int32_t {
  kSuccess = 0,
  kInvalidArgument = 1,
  kNotSupported = 2,
  kInsufficientWorkspace = 3,
  kOutOfHostMemory = 4,
  kOutOfDeviceMemory = 5,
  kCudaError = 6,
  kCublasError = 7,
  kArchMismatch = 8,
  kVersionMismatch = 9,
  kUnknownAttribute = 10,
  kAttributeTypeMismatch = 11,
  kInternalError = 12,
};

class Error : public std::exception {
 public:
  Error(Status status, std::string message) : status_(status), message_(std::move(message)) {}
  Status status() const noexcept { return status_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  Status status_;
  std::string message_;
};

// printf-style throw; the message should name the argument and what was expected.
[[noreturn]] void fail(Status status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace v0
}  // namespace moeblaze
