#include "combine/combine.hpp"

#include <algorithm>

#include "util/rows.hpp"

namespace moeblaze {
inline namespace v0 {
namespace combine {

void combine_outputs(const RoutingPlan& plan, int64_t k, int64_t d, const void* O, DType o_dtype, const View& y,
                     int64_t t0, int64_t t1, float* acc, float* row) {
  const int64_t es = static_cast<int64_t>(dtype_size(o_dtype));
  for (int64_t t = t0; t < t1; ++t) {
    std::fill(acc, acc + d, 0.f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t pos = plan.token_index_map[t * k + j];
      if (pos < 0) continue;  // an empty slot adds nothing
      const float g = plan.gates[t * k + j];
      load_row(static_cast<const char*>(O) + pos * d * es, o_dtype, d, row);
      for (int64_t i = 0; i < d; ++i) acc[i] += g * row[i];
    }
    store_row(y.row(t), y.dtype, d, acc, false);
  }
}

void to_token_order(const RoutingPlan& plan, int64_t k, const float* v, int64_t t0, int64_t t1, float* out) {
  for (int64_t s = t0 * k; s < t1 * k; ++s) out[s] = plan.token_index_map[s] < 0 ? 0.f : v[plan.token_index_map[s]];
}

}  // namespace combine
}  // namespace v0
}  // namespace moeblaze
