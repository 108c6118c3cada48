// Gate functions: from one token's router logits to its top-k experts and their weights.
//
// The families differ (docs/reference-semantics.md has their reference code):
//   kSoftmaxTopK  softmax over all experts -> top-k -> optionally renormalise (sum + eps) -> x
//   scale
//                                        Mixtral, Qwen (scale 1); Step-3.5 without router bias
//   kSigmoidTopK  sigmoid -> choose top-k by (score + selection bias), optionally within the best
//                 `topk_group` of `n_group` groups (a group's score: sum of its best two) ->
//                 weights are the unbiased scores -> optionally renormalise (sum + eps) -> x scale
//                                                                   DeepSeek-V3, Step-3.5-Flash
//   kTopKSoftmax  top-k of the logits -> softmax over those k                         gpt-oss
// With bf16_logits the logits are first rounded to bfloat16 (nearest even), as a router linear
// computed in a bf16 model gives them (Step-3.5 with need_fp32_gate false in a bf16 model).
// Ties in any top-k go to the lower index, so the choice is deterministic. Experts come out in
// descending order of the selection score; combine sums them in that order. Pure functions.
#pragma once

#include <cstdint>
#include <string>

namespace moerun {

enum class GateKind { kSoftmaxTopK, kSigmoidTopK, kTopKSoftmax };

struct GateSpec {
  GateKind kind = GateKind::kSoftmaxTopK;
  int num_experts = 0;
  int top_k = 0;
  bool renormalize = true;
  float renorm_eps = 0.0f;  // added to the sum before dividing (1e-20 for sigmoid gates)
  float scale = 1.0f;       // routed_scaling_factor
  int n_group = 1;          // group-limited selection when > 1
  int topk_group = 1;
  bool selection_bias = false;  // e_score_correction_bias / router_bias (choice only)
  bool bf16_logits = false;     // round the logits to bfloat16 before the gate function
};

const char* GateKindName(GateKind kind);
std::string DescribeGate(const GateSpec& g);

// Scratch for one token; reuse it across tokens of one thread.
struct GateScratch {
  float* probs = nullptr;    // num_experts floats
  float* choice = nullptr;   // num_experts floats (first the rounded logits with bf16_logits)
  int32_t* order = nullptr;  // num_experts ints
};

// logits: num_experts values (router bias already added where the family has one).
// selection_bias: num_experts values or null. Writes top_k ids and weights.
void Route(const GateSpec& g, const float* logits, const float* selection_bias,
           const GateScratch& scratch, int32_t* ids, float* weights);

}  // namespace moerun
