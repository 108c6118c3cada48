#include "router/gate.h"

#include <algorithm>
#include <limits>

#include "base/dtype.h"
#include "base/fast_exp.h"

namespace moerun {
namespace {

// NaN ranks below everything, so the ordering stays strict and weak whatever the input.
inline float Key(float v) { return v != v ? -std::numeric_limits<float>::infinity() : v; }

// Puts the indices of the k largest values first, largest first, ties to the lower index.
void TopK(const float* v, int n, int k, int32_t* order) {
  for (int i = 0; i < n; ++i) order[i] = i;
  std::partial_sort(order, order + k, order + n, [v](int32_t a, int32_t b) {
    const float ka = Key(v[a]);
    const float kb = Key(v[b]);
    if (ka != kb) return ka > kb;
    return a < b;
  });
}

void Renormalize(float* w, int k, float eps) {
  float sum = 0.0f;
  for (int i = 0; i < k; ++i) sum = sum + w[i];
  sum = sum + eps;
  for (int i = 0; i < k; ++i) w[i] = w[i] / sum;
}

}  // namespace

const char* GateKindName(GateKind kind) {
  switch (kind) {
    case GateKind::kSoftmaxTopK:
      return "softmax-topk";
    case GateKind::kSigmoidTopK:
      return "sigmoid-topk";
    case GateKind::kTopKSoftmax:
      return "topk-softmax";
  }
  return "?";
}

std::string DescribeGate(const GateSpec& g) {
  std::string s = GateKindName(g.kind);
  s += " top-" + std::to_string(g.top_k) + "/" + std::to_string(g.num_experts);
  if (g.kind != GateKind::kTopKSoftmax) s += g.renormalize ? " renorm" : " no-renorm";
  if (g.selection_bias) s += " +bias";
  if (g.n_group > 1)
    s += " groups " + std::to_string(g.topk_group) + "/" + std::to_string(g.n_group);
  if (g.scale != 1.0f) s += " x" + std::to_string(g.scale).substr(0, 4);
  if (g.bf16_logits) s += " bf16-logits";
  return s;
}

void Route(const GateSpec& g, const float* logits, const float* selection_bias,
           const GateScratch& scratch, int32_t* ids, float* weights) {
  const int n = g.num_experts;
  const int k = g.top_k;
  float* probs = scratch.probs;
  int32_t* order = scratch.order;
  if (g.bf16_logits) {  // the gate functions below read each logit before they write choice[i]
    for (int i = 0; i < n; ++i) scratch.choice[i] = Bf16ToF32(F32ToBf16(logits[i]));
    logits = scratch.choice;
  }
  switch (g.kind) {
    case GateKind::kSoftmaxTopK: {
      float mx = logits[0];
      for (int i = 1; i < n; ++i) mx = logits[i] > mx ? logits[i] : mx;
      float sum = 0.0f;
      for (int i = 0; i < n; ++i) {
        probs[i] = ExpF(logits[i] - mx);
        sum = sum + probs[i];
      }
      for (int i = 0; i < n; ++i) probs[i] = probs[i] / sum;
      TopK(probs, n, k, order);
      for (int i = 0; i < k; ++i) {
        ids[i] = order[i];
        weights[i] = probs[order[i]];
      }
      if (g.renormalize) Renormalize(weights, k, g.renorm_eps);
      for (int i = 0; i < k; ++i) weights[i] = weights[i] * g.scale;
      break;
    }
    case GateKind::kSigmoidTopK: {
      float* choice = scratch.choice;
      for (int i = 0; i < n; ++i) {
        probs[i] = SigmoidF(logits[i]);
        choice[i] = selection_bias ? probs[i] + selection_bias[i] : probs[i];
      }
      if (g.n_group > 1) {
        const int per = n / g.n_group;
        float group_score[256];
        int32_t group_order[256];
        for (int q = 0; q < g.n_group; ++q) {
          const float* c = choice + q * per;
          float best = -std::numeric_limits<float>::infinity();
          float second = -std::numeric_limits<float>::infinity();
          int best_i = -1;
          for (int i = 0; i < per; ++i) {
            if (best_i < 0 || c[i] > best) {
              second = best;
              best = c[i];
              best_i = i;
            } else if (c[i] > second) {
              second = c[i];
            }
          }
          group_score[q] = per >= 2 ? best + second : best;
        }
        TopK(group_score, g.n_group, g.topk_group, group_order);
        bool keep[256] = {};
        for (int i = 0; i < g.topk_group; ++i) keep[group_order[i]] = true;
        for (int q = 0; q < g.n_group; ++q) {
          if (keep[q]) continue;
          for (int i = 0; i < per; ++i)
            choice[q * per + i] = -std::numeric_limits<float>::infinity();
        }
      }
      TopK(choice, n, k, order);
      for (int i = 0; i < k; ++i) {
        ids[i] = order[i];
        weights[i] = probs[order[i]];
      }
      if (g.renormalize) Renormalize(weights, k, g.renorm_eps);
      for (int i = 0; i < k; ++i) weights[i] = weights[i] * g.scale;
      break;
    }
    case GateKind::kTopKSoftmax: {
      TopK(logits, n, k, order);
      const float mx = logits[order[0]];
      float sum = 0.0f;
      for (int i = 0; i < k; ++i) {
        ids[i] = order[i];
        weights[i] = ExpF(logits[order[i]] - mx);
        sum = sum + weights[i];
      }
      for (int i = 0; i < k; ++i) weights[i] = weights[i] / sum;
      break;
    }
  }
}

}  // namespace moerun
