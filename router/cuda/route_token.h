// The gate functions of router/gate.h for one token, written once for the GPU's route kernel
// (router/cuda/gate_kernels.cu) and the host: the same operations in the same order (CUDA code is
// built with --fmad=false, the host with -ffp-contract=off), top-k by repeated selection with
// ties to the lower index and NaN ranked lowest, which is the order router/gate.cc's partial sort
// gives. tests/unit/route_token_test.cc checks it against Route() on the host. Pure.
#pragma once

#include <cmath>
#include <cstdint>

#include "base/fast_exp.h"
#include "base/host_device.h"
#include "router/gate.h"

namespace moerun::route_token {

constexpr int kMaxExperts = 512;
constexpr int kMaxGroups = 256;

MOERUN_HD inline float Key(float v) { return v != v ? -INFINITY : v; }

// order[0..k): indices of the k largest keys, largest first, ties to the lower index.
// taken: n bits of scratch.
MOERUN_HD inline void TopK(const float* v, int n, int k, int32_t* order, uint32_t* taken) {
  for (int i = 0; i < (n + 31) / 32; ++i) taken[i] = 0;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    float best_key = 0.0f;
    for (int i = 0; i < n; ++i) {
      if (taken[i / 32] & (1u << (i % 32))) continue;
      const float key = Key(v[i]);
      if (best < 0 || key > best_key) {
        best = i;
        best_key = key;
      }
    }
    order[j] = best;
    taken[best / 32] |= 1u << (best % 32);
  }
}

// Round to the nearest bfloat16, ties to even; NaN stays NaN (base/dtype.h's F32ToBf16).
MOERUN_HD inline float RoundBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BitsFloat(((u >> 16) | 0x40u) << 16);
  u += 0x7fffu + ((u >> 16) & 1u);
  return BitsFloat((u >> 16) << 16);
}

MOERUN_HD inline void Renormalize(float* w, int k, float eps) {
  float sum = 0.0f;
  for (int i = 0; i < k; ++i) sum = sum + w[i];
  sum = sum + eps;
  for (int i = 0; i < k; ++i) w[i] = w[i] / sum;
}

struct Scratch {
  float* probs;     // num_experts
  int32_t* order;   // num_experts
  uint32_t* taken;  // num_experts / 32 + 1
};

// logit: num_experts values (router bias added), overwritten. ids/weights: top_k each.
MOERUN_HD inline void Route(const GateSpec& g, float* logit, const float* selection_bias,
                            const Scratch& s, int32_t* ids, float* w) {
  const int n = g.num_experts, k = g.top_k;
  float* probs = s.probs;
  int32_t* order = s.order;
  if (g.bf16_logits) {
    for (int i = 0; i < n; ++i) logit[i] = RoundBf16(logit[i]);
  }
  switch (g.kind) {
    case GateKind::kSoftmaxTopK: {
      float mx = logit[0];
      for (int i = 1; i < n; ++i) mx = logit[i] > mx ? logit[i] : mx;
      float sum = 0.0f;
      for (int i = 0; i < n; ++i) {
        probs[i] = ExpF(logit[i] - mx);
        sum = sum + probs[i];
      }
      for (int i = 0; i < n; ++i) probs[i] = probs[i] / sum;
      TopK(probs, n, k, order, s.taken);
      for (int i = 0; i < k; ++i) {
        ids[i] = order[i];
        w[i] = probs[order[i]];
      }
      if (g.renormalize) Renormalize(w, k, g.renorm_eps);
      for (int i = 0; i < k; ++i) w[i] = w[i] * g.scale;
      break;
    }
    case GateKind::kSigmoidTopK: {
      float* choice = logit;  // each logit is read before its choice overwrites it
      for (int i = 0; i < n; ++i) {
        probs[i] = SigmoidF(logit[i]);
        choice[i] = selection_bias ? probs[i] + selection_bias[i] : probs[i];
      }
      if (g.n_group > 1) {
        const int per = n / g.n_group;
        float group_score[kMaxGroups];
        int32_t group_order[kMaxGroups];
        for (int q = 0; q < g.n_group; ++q) {
          const float* c = choice + q * per;
          float best = -INFINITY, second = -INFINITY;
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
        TopK(group_score, g.n_group, g.topk_group, group_order, s.taken);
        bool keep[kMaxGroups] = {};
        for (int i = 0; i < g.topk_group; ++i) keep[group_order[i]] = true;
        for (int q = 0; q < g.n_group; ++q) {
          if (keep[q]) continue;
          for (int i = 0; i < per; ++i) choice[q * per + i] = -INFINITY;
        }
      }
      TopK(choice, n, k, order, s.taken);
      for (int i = 0; i < k; ++i) {
        ids[i] = order[i];
        w[i] = probs[order[i]];
      }
      if (g.renormalize) Renormalize(w, k, g.renorm_eps);
      for (int i = 0; i < k; ++i) w[i] = w[i] * g.scale;
      break;
    }
    case GateKind::kTopKSoftmax: {
      TopK(logit, n, k, order, s.taken);
      const float mx = logit[order[0]];
      float sum = 0.0f;
      for (int i = 0; i < k; ++i) {
        ids[i] = order[i];
        w[i] = ExpF(logit[order[i]] - mx);
        sum = sum + w[i];
      }
      for (int i = 0; i < k; ++i) w[i] = w[i] / sum;
      break;
    }
  }
}

}  // namespace moerun::route_token
