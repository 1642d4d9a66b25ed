#include "ep/host_layer.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "ep/exchange.hpp"
#include "experts/expert_mlp.hpp"

namespace moeblaze {
inline namespace v0 {
namespace ep {

namespace {

// Each send's record: the token's rows of `sources` (d floats each), then per row slot its local
// expert (as a float; -1 past the row's experts) and gate.
std::vector<float> pack_records(const SendPlan& sp, const HostForwardArgs& a, std::initializer_list<const float*> sources) {
  const int64_t d = a.hidden, meta = d * static_cast<int64_t>(sources.size()), rec = meta + 2 * sp.row_slots;
  std::vector<float> send(static_cast<size_t>(sp.sends()) * rec);
  for (int32_t s = 0; s < sp.sends(); ++s) {
    float* r = &send[static_cast<size_t>(s) * rec];
    const int64_t t = sp.token[s];
    int64_t at = 0;
    for (const float* src : sources) {
      std::memcpy(r + at, src + t * d, d * sizeof(float));
      at += d;
    }
    for (int32_t i = 0; i < sp.row_slots; ++i) {
      const int32_t slot = sp.topk_slot[static_cast<size_t>(s) * sp.row_slots + i];
      r[meta + 2 * i] = static_cast<float>(sp.local_expert[static_cast<size_t>(s) * sp.row_slots + i]);
      r[meta + 2 * i + 1] = slot >= 0 ? a.gates[t * a.top_k + slot] : 0.f;
    }
  }
  return send;
}

// The received rows that feed local expert e, in receive order, with their gates and row slots
// (records of `rec` floats, the experts and gates from float `meta` on).
void rows_of_expert(const std::vector<float>& recv, int64_t rec, int64_t meta, int32_t row_slots, int32_t e,
                    std::vector<int64_t>& rows, std::vector<float>& gates, std::vector<int32_t>& slots) {
  rows.clear();
  gates.clear();
  slots.clear();
  const int64_t R = static_cast<int64_t>(recv.size()) / rec;
  for (int64_t i = 0; i < R; ++i) {
    const float* r = &recv[static_cast<size_t>(i) * rec];
    for (int32_t j = 0; j < row_slots; ++j)
      if (r[meta + 2 * j] == static_cast<float>(e)) {
        rows.push_back(i);
        gates.push_back(r[meta + 2 * j + 1]);
        slots.push_back(j);
      }
  }
}

// Expert e (local) over n rows xe [n, d]: pre [n, g h], act [n, h] and its output o [n, d],
// each resized to fit.
void expert_forward(const HostForwardArgs& a, int32_t e, int64_t n, const std::vector<float>& xe, std::vector<float>& pre,
                    std::vector<float>& act, std::vector<float>& o, std::vector<float>& scratch) {
  const int64_t d = a.hidden, h = a.ffn, gh = (is_gated(a.activation) ? 2 : 1) * h;
  pre.resize(n * gh);
  act.resize(n * h);
  o.resize(n * d);
  experts::gemm_weight(n, gh, d, xe.data(), d, a.w_gate_up, e, false, pre.data(), gh, scratch.data());
  experts::activation_forward(a.activation, n, h, pre.data(), act.data(), DType::kF32);
  experts::gemm_weight(n, d, h, act.data(), h, a.w_down, e, false, o.data(), d, scratch.data());
}

}  // namespace

int32_t host_forward(Transport& tr, const Placement& pl, const HostForwardArgs& a, float* y) {
  const int64_t d = a.hidden, h = a.ffn, gh = (is_gated(a.activation) ? 2 : 1) * h;
  const int32_t k = a.top_k;
  const SendPlan sp = make_send_plan(pl, a.topk_ids, a.tokens, k);
  const Counts counts = exchange_counts(tr, sp, a.max_recv_rows, a.flag);
  if (counts.flag) {  // every rank decided alike from the same matrix: no row moves
    std::fill(y, y + a.tokens * d, NAN);
    return counts.flag;
  }
  const std::vector<int64_t>& recv_off = counts.recv_off;
  const int64_t R = recv_off.back();
  const int64_t rec = d + 2 * sp.row_slots;  // pack_records: x, then the experts and gates
  const std::vector<float> send = pack_records(sp, a, {a.x});
  std::vector<float> recv(static_cast<size_t>(R) * rec);
  dispatch_rows(tr, sp, recv_off, send.data(), rec * static_cast<int64_t>(sizeof(float)), recv.data());

  // The local experts, in id order, each over the received rows that feed it; a row's partial
  // sum so gathers its experts in id order.
  std::vector<float> partial(static_cast<size_t>(R) * d, 0.f);
  std::vector<int64_t> rows;
  std::vector<int32_t> slots;
  std::vector<float> gate, xe, pre, act, out;
  std::vector<float> scratch(std::max<int64_t>({experts::kColBlock, d, gh}));
  for (int32_t e = 0; e < pl.experts_per_rank(); ++e) {
    rows_of_expert(recv, rec, d, sp.row_slots, e, rows, gate, slots);
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0) continue;
    xe.resize(n * d);
    for (int64_t r = 0; r < n; ++r) std::memcpy(&xe[r * d], &recv[static_cast<size_t>(rows[r]) * rec], d * sizeof(float));
    expert_forward(a, e, n, xe, pre, act, out, scratch);
    for (int64_t r = 0; r < n; ++r) {
      float* p = &partial[static_cast<size_t>(rows[r]) * d];
      for (int64_t c = 0; c < d; ++c) p[c] += gate[r] * out[r * d + c];
    }
  }

  std::vector<float> back(static_cast<size_t>(sp.sends()) * d);
  return_rows(tr, sp, recv_off, partial.data(), d * static_cast<int64_t>(sizeof(float)), back.data());
  std::fill(y, y + a.tokens * d, 0.f);
  for (int64_t t = 0; t < a.tokens; ++t)
    for (int32_t i = 0; i < sp.token_slots; ++i) {
      const int32_t s = sp.token_send[t * sp.token_slots + i];
      if (s < 0) break;
      for (int64_t c = 0; c < d; ++c) y[t * d + c] += back[static_cast<size_t>(s) * d + c];
    }
  return 0;
}

int32_t host_backward(Transport& tr, const Placement& pl, const HostForwardArgs& a, const float* dy,
                      const HostBackwardOut& out) {
  const int64_t d = a.hidden, h = a.ffn, gh = (is_gated(a.activation) ? 2 : 1) * h;
  const int32_t k = a.top_k;
  const int32_t El = pl.experts_per_rank();
  const SendPlan sp = make_send_plan(pl, a.topk_ids, a.tokens, k);
  const Counts counts = exchange_counts(tr, sp, a.max_recv_rows, a.flag);
  if (counts.flag) {
    std::fill(out.dx, out.dx + a.tokens * d, NAN);
    std::fill(out.dgates, out.dgates + a.tokens * k, NAN);
    std::fill(out.dw_gate_up, out.dw_gate_up + El * d * gh, NAN);
    std::fill(out.dw_down, out.dw_down + El * h * d, NAN);
    return counts.flag;
  }
  const std::vector<int64_t>& recv_off = counts.recv_off;
  const int64_t R = recv_off.back();
  const int64_t rec = 2 * d + 2 * sp.row_slots;  // pack_records: x, dy, then the experts and gates
  const std::vector<float> send = pack_records(sp, a, {a.x, dy});
  std::vector<float> recv(static_cast<size_t>(R) * rec);
  dispatch_rows(tr, sp, recv_off, send.data(), rec * static_cast<int64_t>(sizeof(float)), recv.data());

  // What goes back per row: its partial dx, then its gate gradients by row slot.
  const int64_t back_rec = d + sp.row_slots;
  std::vector<float> back_send(static_cast<size_t>(R) * back_rec, 0.f);
  std::fill(out.dw_gate_up, out.dw_gate_up + El * d * gh, 0.f);  // experts without rows
  std::fill(out.dw_down, out.dw_down + El * h * d, 0.f);
  std::vector<int64_t> rows;
  std::vector<int32_t> slots;
  std::vector<float> gate, xe, dye, pre, act, o, dact, dpre, dxe, outer_a, outer_g;
  std::vector<float> scratch(std::max<int64_t>({experts::kColBlock, d, gh}));
  for (int32_t e = 0; e < El; ++e) {
    rows_of_expert(recv, rec, 2 * d, sp.row_slots, e, rows, gate, slots);
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0) continue;
    xe.resize(n * d);
    dye.resize(n * d);
    dact.resize(n * h);
    dpre.resize(n * gh);
    dxe.resize(n * d);
    for (int64_t r = 0; r < n; ++r) {
      const float* src = &recv[static_cast<size_t>(rows[r]) * rec];
      std::memcpy(&xe[r * d], src, d * sizeof(float));
      std::memcpy(&dye[r * d], src + d, d * sizeof(float));
    }
    expert_forward(a, e, n, xe, pre, act, o, scratch);  // o: for the gate gradients <dy, o>
    experts::gemm_weight(n, h, d, dye.data(), d, a.w_down, e, true, dact.data(), h, scratch.data());
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < h; ++c) dact[r * h + c] *= gate[r];
    experts::activation_backward(a.activation, n, h, pre.data(), dact.data(), dpre.data(), DType::kF32);
    experts::gemm_weight(n, d, gh, dpre.data(), gh, a.w_gate_up, e, true, dxe.data(), d, scratch.data());
    for (int64_t r = 0; r < n; ++r) {
      float* b = &back_send[static_cast<size_t>(rows[r]) * back_rec];
      for (int64_t c = 0; c < d; ++c) b[c] += dxe[r * d + c];
      b[d + slots[r]] = experts::dot(&dye[r * d], &o[r * d], d);
    }
    // dW_gate_up[e] = sum_r x_r (outer) dpre_r and dW_down[e] = sum_r (g_r act_r) (outer) dy_r,
    // rows in receive order.
    outer_a.resize(experts::kOuterRows * std::max(d, h));
    outer_g.resize(experts::kOuterRows * std::max(d, gh));
    experts::accumulate_outer(
        n, d, gh,
        [&](int64_t r, float* xa, float* ga) {
          std::copy_n(&xe[r * d], d, xa);
          std::copy_n(&dpre[r * gh], gh, ga);
        },
        out.dw_gate_up + e * d * gh, outer_a.data(), outer_g.data());
    experts::accumulate_outer(
        n, h, d,
        [&](int64_t r, float* aa, float* ga) {
          for (int64_t i = 0; i < h; ++i) aa[i] = gate[r] * act[r * h + i];
          std::copy_n(&dye[r * d], d, ga);
        },
        out.dw_down + e * h * d, outer_a.data(), outer_g.data());
  }

  std::vector<float> back(static_cast<size_t>(sp.sends()) * back_rec);
  return_rows(tr, sp, recv_off, back_send.data(), back_rec * static_cast<int64_t>(sizeof(float)), back.data());
  std::fill(out.dx, out.dx + a.tokens * d, 0.f);
  std::fill(out.dgates, out.dgates + a.tokens * k, 0.f);
  for (int64_t t = 0; t < a.tokens; ++t)
    for (int32_t i = 0; i < sp.token_slots; ++i) {
      const int32_t s = sp.token_send[t * sp.token_slots + i];
      if (s < 0) break;
      const float* b = &back[static_cast<size_t>(s) * back_rec];
      for (int64_t c = 0; c < d; ++c) out.dx[t * d + c] += b[c];
      for (int32_t j = 0; j < sp.row_slots; ++j) {
        const int32_t slot = sp.topk_slot[static_cast<size_t>(s) * sp.row_slots + j];
        if (slot >= 0) out.dgates[t * k + slot] = b[d + j];
      }
    }
  return 0;
}

}  // namespace ep
}  // namespace v0
}  // namespace moeblaze
