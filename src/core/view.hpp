// View: a validated strided tensor of up to 3 dimensions, the only argument type the stages
// (routing, experts, combine) see. core/args.cpp builds them from the C API's descriptors.
#pragma once

#include <cstddef>
#include <cstdint>

#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {

// A validated strided view of up to 3 dimensions; strides in elements, innermost stride 1.
//
// transposed (expert weights and their gradients only): the caller's [E, R, C] tensor stores each
// expert's matrix column-major (nn.Linear's [E, C, R], seen through swapped strides). The view
// then describes that physical, row-major [E, C, R] array: shape[1] = C, shape[2] = R, stride[1]
// its row pitch. Anything that treats the view as plain memory (poison, zero fill, bounds) works
// unchanged; the GEMM stages read element (r, c) of expert e at row(e, c)[r] instead of row(e, r)[c].
struct View {
  bool present = false;
  bool accumulate = false;
  bool transposed = false;
  char* data = nullptr;
  DType dtype = DType::kInvalid;
  int ndim = 0;
  int64_t shape[3] = {0, 0, 0};
  int64_t stride[3] = {0, 0, 0};
  size_t span_bytes = 0;  // bytes from data to one past the last element (0 for no elements)

  size_t elem() const { return dtype_size(dtype); }
  // Row r of a 2-D view, or row (a, r) of a 3-D view.
  char* row(int64_t r) const { return data + r * stride[0] * static_cast<int64_t>(elem()); }
  char* row(int64_t a, int64_t r) const {
    return data + (a * stride[0] + r * stride[1]) * static_cast<int64_t>(elem());
  }
  // Rows [r0, r0 + n) of a 2-D view, as a view of its own (an absent view stays absent).
  View rows(int64_t r0, int64_t n) const {
    View v = *this;
    if (!present) return v;
    v.data = row(r0);
    v.shape[0] = n;
    v.span_bytes = n > 0 ? static_cast<size_t>(((n - 1) * stride[0] + shape[1]) * static_cast<int64_t>(elem())) : 0;
    return v;
  }
  // Element i of a 1-D index view (i32 or i64), on the host.
  int64_t index(int64_t i) const {
    const char* p = data + i * stride[0] * static_cast<int64_t>(elem());
    return dtype == DType::kI64 ? *reinterpret_cast<const int64_t*>(p) : *reinterpret_cast<const int32_t*>(p);
  }
};

}  // namespace v0
}  // namespace moeblaze
