// Byte-size helpers for workspace and saved-buffer layouts.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moeblaze {
inline namespace v0 {

constexpr size_t kBufferAlignment = 256;  // == MOEBLAZE_BUFFER_ALIGNMENT

constexpr size_t align_up(size_t bytes, size_t a = kBufferAlignment) {
  return (bytes + a - 1) / a * a;
}
constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Carves aligned regions out of one caller buffer, or (with base == nullptr) only measures.
class Carver {
 public:
  explicit Carver(void* base = nullptr) : base_(static_cast<char*>(base)) {}
  template <class T>
  T* take(size_t count) {
    size_t off = offset_;
    offset_ += align_up(count * sizeof(T));
    return base_ ? reinterpret_cast<T*>(base_ + off) : nullptr;
  }
  size_t size() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

}  // namespace v0
}  // namespace moeblaze
