// What moerun needs to know of a model, read from its Hugging Face config.json: which decoder
// layers are MoE layers, and for those the expert count, top-k, sizes, gate function, shared
// experts and activation limits. One struct for every family; ParseModelSpec reads the keys each
// family's published checkpoints use and validates them (top-k <= experts, groups divide the
// experts, sizes positive...), naming the offending key in its error. Plain data; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "experts/cpu/kernels.h"
#include "router/gate.h"
#include "runtime/model/quant_config.h"

namespace moerun {

enum class Family { kMixtral, kQwen2Moe, kQwen3Moe, kDeepseekV3, kGptOss, kStep3p5 };

const char* FamilyName(Family f);  // the config's model_type

struct ModelSpec {
  Family family = Family::kMixtral;
  int64_t hidden = 0;
  int num_layers = 0;
  std::vector<int> moe_layers;  // ascending

  int num_experts = 0;
  int top_k = 0;
  int64_t expert_inter = 0;  // intermediate size of one routed expert
  GateSpec gate;
  bool router_bias = false;  // gpt-oss: the router linear has a bias
  bool expert_bias = false;  // gpt-oss: the expert projections have biases

  int64_t shared_inter = 0;   // 0: no shared expert
  bool shared_gated = false;  // Qwen2-MoE: shared output x sigmoid(shared_expert_gate . x)

  ActKind act = ActKind::kSwiGlu;
  float swiglu_limit = 0.0f;  // gpt-oss (all layers)
  float swiglu_alpha = 1.702f;
  std::vector<float> swiglu_limits;         // Step-3.5-Flash, per layer (0: none)
  std::vector<float> swiglu_limits_shared;  // Step-3.5-Flash, per layer (0: none)
  std::string torch_dtype;                  // as published, informational
  QuantSpec quant;                          // quantization_config (the experts' format)

  bool IsMoeLayer(int layer) const;
  int FirstMoeLayer() const { return moe_layers.empty() ? -1 : moe_layers.front(); }
  ActParams RoutedAct(int layer) const;
  ActParams SharedAct(int layer) const;
  // One line: "deepseek_v3: 58/61 MoE layers (3..60), 256 experts top-8, hidden 7168, ..."
  std::string Summary() const;
  // Checks the invariants the layer relies on (used after parsing and for presets).
  Status Validate() const;
};

// `source` names the file in errors.
Result<ModelSpec> ParseModelSpec(const std::string& json_text, const std::string& source);
// Reads DIR/config.json.
Result<ModelSpec> LoadModelSpec(const std::string& model_dir);

// "3,4,5" / "3-5" style list of layer numbers, as in Step-3.5-Flash's moe_layers_enum.
Result<std::vector<int>> ParseLayerList(const std::string& text, int num_layers);

}  // namespace moerun
