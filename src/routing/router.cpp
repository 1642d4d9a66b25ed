#include "routing/router.hpp"

#include <algorithm>
#include <cmath>

#include "routing/score_order.hpp"
#include "routing/selection.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace {

// scores[e] from one logits row; returns logsumexp(logits).
float scores_of(const LayerConfig& cfg, const float* l, int64_t E, float* s) {
  float m = -INFINITY;
  for (int64_t e = 0; e < E; ++e) m = max_skipping_nan(m, l[e]);
  // The normaliser sums E terms: in fp64, so it stays accurate for any E (E = 65536 in fp32
  // would lose ~1e-5 relative, and engines summing in different orders would disagree).
  double sum = 0.0;
  for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(l[e] - m));
  const float lse = m + static_cast<float>(std::log(sum));
  if (cfg.score_fn == ScoreFn::kSoftmax) {
    for (int64_t e = 0; e < E; ++e) s[e] = std::exp(l[e] - lse);
  } else {
    for (int64_t e = 0; e < E; ++e) s[e] = 1.f / (1.f + std::exp(-l[e]));
  }
  return lse;
}

// The k first candidates under routing::ranks_before of their value r(e), in rank order: pick
// j is the best of those ranked after pick j - 1 (no taken-list; NaN ranks last). O(k n).
template <class Value, class Allowed>
void top_k(Value r, Allowed allowed, int64_t n, int64_t k, int32_t* ids) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < n; ++e) {
      if (!allowed(e) || (j > 0 && !ranks_before(r(ids[j - 1]), ids[j - 1], r(e), e))) continue;
      if (ranks_before(r(e), e, best >= 0 ? r(best) : 0.f, best)) best = e;
    }
    ids[j] = static_cast<int32_t>(best);
  }
}

// Group-limited routing (DeepSeek-V3): a group's score is the sum of its two best selection
// values (its only one for groups of one); the topk_groups best groups under ranks_before stay
// open. Returns the last group kept (the worst of them) and its score: group g is open when it
// ranks before that one or is that one.
struct GroupCut {
  float score;
  int64_t id;
  bool open(float s, int64_t g) const { return g == id || ranks_before(s, g, score, id); }
};

template <class Value>
GroupCut group_cut(Value v, int64_t E, int64_t groups, int64_t keep, float* group_score) {
  const int64_t size = E / groups;
  for (int64_t g = 0; g < groups; ++g) {
    int32_t two[2] = {0, 0};
    const int64_t n = std::min<int64_t>(2, size);
    top_k([&](int64_t i) { return v(g * size + i); }, [](int64_t) { return true; }, size, n, two);
    group_score[g] = n == 2 ? v(g * size + two[0]) + v(g * size + two[1]) : v(g * size + two[0]);
  }
  GroupCut cut{0.f, -1};
  for (int64_t j = 0; j < keep; ++j) {
    int64_t best = -1;
    for (int64_t g = 0; g < groups; ++g) {
      if (j > 0 && !ranks_before(cut.score, cut.id, group_score[g], g)) continue;
      if (ranks_before(group_score[g], g, best >= 0 ? group_score[best] : 0.f, best)) best = g;
    }
    cut = {group_score[best], best};
  }
  return cut;
}

// d logits of one token from d scores (its logits l, scores s): the score function's Jacobian.
void scores_backward(const LayerConfig& cfg, const float* l, const float* s, const float* ds, int64_t E, float* dl) {
  if (cfg.score_fn == ScoreFn::kSoftmax) {
    // dl = s (ds - <s, ds>) cancels badly in fp32 when one score is near 1; shifting ds by
    // its value at the top score first (softmax is shift-invariant in ds) keeps it exact.
    int64_t top = 0;
    for (int64_t e = 1; e < E; ++e) top = ranks_before(s[e], e, s[top], top) ? e : top;
    const float shift = ds[top];
    double dot = 0.0;  // an E-term reduction: fp64, as for the normaliser
    for (int64_t e = 0; e < E; ++e) dot += static_cast<double>((ds[e] - shift) * s[e]);
    const float dotf = static_cast<float>(dot);
    for (int64_t e = 0; e < E; ++e) dl[e] = s[e] * ((ds[e] - shift) - dotf);
  } else {  // s (1 - s) as sigmoid(l) sigmoid(-l): no cancellation for saturated scores
    for (int64_t e = 0; e < E; ++e) dl[e] = ds[e] * s[e] * (1.f / (1.f + std::exp(l[e])));
  }
}

// n[e]: the picks of each expert among tokens [t0, t0 + T); returns the routed tokens among
// them (a masked token's slots are empty, -1).
int64_t count_picks(const int32_t* ids, int64_t t0, int64_t T, int64_t k, int64_t E, float* n) {
  for (int64_t e = 0; e < E; ++e) n[e] = 0.f;
  int64_t routed = 0;
  for (int64_t t = t0; t < t0 + T; ++t) {
    if (ids[t * k] < 0) continue;
    ++routed;
    for (int64_t j = 0; j < k; ++j) n[ids[t * k + j]] += 1.f;
  }
  return routed;
}

// The scores normalised to sum 1 (sigmoid; softmax scores already do and are left as they are).
void normalise_scores(const LayerConfig& cfg, float* s, int64_t E) {
  if (cfg.score_fn == ScoreFn::kSoftmax) return;
  double sum = 0.0;
  for (int64_t e = 0; e < E; ++e) sum += s[e];
  const float S = static_cast<float>(sum);
  for (int64_t e = 0; e < E; ++e) s[e] /= S;
}

}  // namespace

int64_t routed_sequences(const int32_t* ids, const View& lengths, int64_t k) {
  int64_t routed = 0, t0 = 0;
  for (int64_t q = 0; q < lengths.shape[0]; ++q) {
    const int64_t T = lengths.index(q);
    for (int64_t t = t0; t < t0 + T; ++t)
      if (ids[t * k] >= 0) {
        ++routed;
        break;
      }
    t0 += T;
  }
  return routed;
}

float sequence_balance_loss(const LayerConfig& cfg, const float* logits, const int32_t* ids, const View& lengths,
                            float* scratch) {
  const int64_t B = routed_sequences(ids, lengths, cfg.top_k);
  const int64_t E = cfg.num_experts, k = cfg.top_k;
  float *s = scratch, *P = scratch + E, *n = scratch + 2 * E;
  double total = 0.0;
  int64_t t0 = 0;
  for (int64_t q = 0; q < lengths.shape[0]; ++q) {
    const int64_t T = lengths.index(q);
    for (int64_t e = 0; e < E; ++e) P[e] = 0.f;
    for (int64_t t = t0; t < t0 + T; ++t) {
      if (ids[t * k] < 0) continue;  // masked
      scores_of(cfg, logits + t * E, E, s);
      normalise_scores(cfg, s, E);
      for (int64_t e = 0; e < E; ++e) P[e] += s[e];
    }
    const int64_t routed = count_picks(ids, t0, T, k, E, n);
    t0 += T;
    if (routed == 0) continue;
    double sq = 0.0;
    for (int64_t e = 0; e < E; ++e) sq += static_cast<double>(n[e]) * static_cast<double>(P[e]);
    total += sq * static_cast<double>(E) /
             (static_cast<double>(k) * static_cast<double>(routed) * static_cast<double>(routed));
  }
  return B > 0 && cfg.aux_loss_coeff != 0.0 ? static_cast<float>(cfg.aux_loss_coeff * total / static_cast<double>(B))
                                            : 0.f;
}

void sequence_balance_backward(const LayerConfig& cfg, const float* logits, const int32_t* ids, int64_t t0, int64_t T,
                               int64_t B, float grad_aux, float* dlogits, float* scratch) {
  const int64_t E = cfg.num_experts, k = cfg.top_k;
  float *s = scratch, *ds = scratch + E, *dl = scratch + 2 * E, *n = scratch + 3 * E;
  const int64_t routed = count_picks(ids, t0, T, k, E, n);
  if (routed == 0) return;
  // d loss / d s'_te = c n_e, c = coeff * grad_aux * E / (B k T^2) (T: the sequence's routed
  // tokens); through s' = s / S (sigmoid): ds_f = (c n_f - sum_e c n_e s'_e) / S.
  const double c = cfg.aux_loss_coeff * grad_aux * static_cast<double>(E) /
                   (static_cast<double>(B) * static_cast<double>(k) * static_cast<double>(routed) *
                    static_cast<double>(routed));
  for (int64_t t = t0; t < t0 + T; ++t) {
    if (ids[t * k] < 0) continue;  // masked: zero d logits
    const float* l = logits + t * E;
    scores_of(cfg, l, E, s);
    if (cfg.score_fn == ScoreFn::kSoftmax) {
      for (int64_t e = 0; e < E; ++e) ds[e] = static_cast<float>(c * n[e]);
    } else {
      double S = 0.0, dot = 0.0;
      for (int64_t e = 0; e < E; ++e) S += s[e];
      for (int64_t e = 0; e < E; ++e) dot += static_cast<double>(n[e]) * (s[e] / S);
      for (int64_t e = 0; e < E; ++e) ds[e] = static_cast<float>(c * (n[e] - dot) / S);
    }
    scores_backward(cfg, l, s, ds, E, dl);
    float* row = dlogits + t * E;
    for (int64_t e = 0; e < E; ++e) row[e] += dl[e];
  }
}

void selection_scores(const LayerConfig& cfg, const float* l, int64_t E, float* v) {
  if (cfg.score_fn == ScoreFn::kSigmoid) {
    for (int64_t e = 0; e < E; ++e) v[e] = sigmoid_selection(l[e]);
    return;
  }
  float m = -INFINITY;
  for (int64_t e = 0; e < E; ++e) m = max_skipping_nan(m, l[e]);
  for (int64_t e = 0; e < E; ++e) v[e] = exp_portable(l[e] - m);
  const double S = fixed_order_sum(E, [&](int64_t e) { return v[e]; });
  for (int64_t e = 0; e < E; ++e) v[e] = softmax_selection(v[e], S);
}

void route_tokens(const LayerConfig& cfg, const float* logits, const float* bias, const View& mask, int64_t t0,
                  int64_t t1, int32_t* ids, float* gates, float* score_sum, float* lse_sq_sum, float* s) {
  const int64_t E = cfg.num_experts, k = cfg.top_k, groups = cfg.num_expert_groups;
  const bool limited = cfg.topk_groups > 0 && cfg.topk_groups < groups;
  float* sel = s + E;              // selection scores (routing/selection.hpp), with a bias or groups
  float* group_score = s + 2 * E;  // [groups]
  for (int64_t t = t0; t < t1; ++t) {
    if (mask.present && mask.index(t) == 0) {  // masked: k empty slots, left out of the losses
      for (int64_t j = 0; j < k; ++j) ids[t * k + j] = -1, gates[t * k + j] = 0.f;
      continue;
    }
    const float* l = logits + t * E;
    const float lse = scores_of(cfg, l, E, s);
    *lse_sq_sum += lse * lse;
    for (int64_t e = 0; e < E; ++e) score_sum[e] += s[e];
    int32_t* id = ids + t * k;
    if (bias || limited) {
      selection_scores(cfg, l, E, sel);
      if (bias)
        for (int64_t e = 0; e < E; ++e) sel[e] += bias[e];
    }
    // Selection values: the biased selection scores with a bias; without one, the rank value
    // (the logit) for top-k, and the selection scores for group sums.
    auto value = [&](int64_t e) { return sel[e]; };
    auto rank = [&](int64_t e) { return rank_value(l[e], s[e]); };
    if (limited) {
      const GroupCut cut = group_cut(value, E, groups, cfg.topk_groups, group_score);
      const int64_t size = E / groups;
      auto open = [&](int64_t e) { return cut.open(group_score[e / size], e / size); };
      if (bias) top_k(value, open, E, k, id);
      else top_k(rank, open, E, k, id);
    } else {
      auto all = [](int64_t) { return true; };
      if (bias) top_k(value, all, E, k, id);
      else top_k(rank, all, E, k, id);
    }
    float norm = 0.f;
    for (int64_t j = 0; j < k; ++j) norm += s[id[j]];
    const float scale = static_cast<float>(cfg.route_scale);  // 1 leaves the gates' bits as they are
    for (int64_t j = 0; j < k; ++j) gates[t * k + j] = (cfg.normalize_topk ? s[id[j]] / norm : s[id[j]]) * scale;
  }
}

RouterLosses finish_losses(const LayerConfig& cfg, int64_t L, const float* chunk_score_sums,
                           const float* chunk_lse_sq, int64_t num_chunks, const int32_t* offsets) {
  RouterLosses r{0.f, 0.f};
  if (L == 0) return r;
  const int64_t E = cfg.num_experts;
  double aux = 0.0, z = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    double p = 0.0;
    for (int64_t c = 0; c < num_chunks; ++c) p += chunk_score_sums[c * E + e];
    const double f = static_cast<double>(offsets[e + 1] - offsets[e]) / static_cast<double>(L * cfg.top_k);
    aux += f * (p / static_cast<double>(L));
  }
  for (int64_t c = 0; c < num_chunks; ++c) z += chunk_lse_sq[c];
  // A loss whose coefficient is 0 reads 0, even over non-finite scores.
  if (cfg.balance_coeff() != 0.0) r.aux = static_cast<float>(cfg.balance_coeff() * static_cast<double>(E) * aux);
  if (cfg.z_loss_coeff != 0.0) r.z = static_cast<float>(cfg.z_loss_coeff * z / static_cast<double>(L));
  return r;
}

void router_backward(const LayerConfig& cfg, int64_t L, const float* logits, const int32_t* ids,
                     const float* dgates, float grad_aux, float grad_z, const int32_t* offsets, int64_t t0,
                     int64_t t1, float* dlogits, float* scratch) {
  const int64_t E = cfg.num_experts, k = cfg.top_k;
  float* s = scratch;
  float* ds = scratch + E;
  const float aux_scale = static_cast<float>(cfg.balance_coeff()) * grad_aux * static_cast<float>(E) /
                          (static_cast<float>(L) * static_cast<float>(L * k));
  const float z_scale = static_cast<float>(cfg.z_loss_coeff) * grad_z * 2.f / static_cast<float>(L);
  for (int64_t t = t0; t < t1; ++t) {
    float* dl = dlogits + t * E;
    if (ids[t * k] < 0) {  // a masked token (empty slots): no gradient
      for (int64_t e = 0; e < E; ++e) dl[e] = 0.f;
      continue;
    }
    const float* l = logits + t * E;
    const float lse = scores_of(cfg, l, E, s);
    for (int64_t e = 0; e < E; ++e) ds[e] = 0.f;
    const int32_t* id = ids + t * k;
    // The gates are scale * (renormalised) scores: d gates times the scale first.
    const float* dg = dgates + t * k;
    const float scale = static_cast<float>(cfg.route_scale);
    if (cfg.normalize_topk) {
      float norm = 0.f, dot = 0.f;
      for (int64_t j = 0; j < k; ++j) norm += s[id[j]];
      for (int64_t j = 0; j < k; ++j) dot += dg[j] * scale * (s[id[j]] / norm);
      for (int64_t j = 0; j < k; ++j) ds[id[j]] += (dg[j] * scale - dot) / norm;
    } else {
      for (int64_t j = 0; j < k; ++j) ds[id[j]] += dg[j] * scale;
    }
    if (cfg.aux_loss_coeff > 0.0 && offsets)  // d aux / d s_te = coeff * E * f_e / L, f_e = count_e / (L k)
      for (int64_t e = 0; e < E; ++e) ds[e] += aux_scale * static_cast<float>(offsets[e + 1] - offsets[e]);
    scores_backward(cfg, l, s, ds, E, dl);
    if (cfg.z_loss_coeff > 0.0)  // d lse / d l_e = softmax_e, whatever the score function
      for (int64_t e = 0; e < E; ++e) dl[e] += z_scale * lse * std::exp(l[e] - lse);
  }
}

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
