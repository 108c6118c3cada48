// The weights of one MoE layer as a checkpoint or a preset yields them, packed for one CPU kernel
// variant: the router's tensors (gate, biases, the shared expert) and the experts this process
// loaded (the others stay empty). Plain data; shared read-only between threads once built.
#pragma once

#include <cstddef>
#include <optional>
#include <vector>

#include "base/dtype.h"
#include "experts/cpu/expert_weights.h"
#include "experts/cpu/packed_matrix.h"
#include "router/gating.h"
#include "runtime/model/model_spec.h"

namespace moerun {

struct MoeLayerWeights {
  ModelSpec spec;
  int layer = 0;
  DType dtype = DType::kF32;  // type the expert weights are held in
  // Router: N = num_experts (+1: the Qwen2-MoE shared-expert gate rides along as the last row).
  PackedMatrix gate;
  std::vector<float> gate_bias;        // router bias, padded to gate.n_padded(); or empty
  std::vector<float> selection_bias;   // [num_experts] or empty
  std::vector<ExpertWeights> experts;  // [num_experts]; unloaded experts have empty w13
  std::optional<ExpertWeights> shared;

  size_t ExpertBytes() const;
  // The gate's view of these weights (valid while they live).
  GateWeights Gate() const;
};

}  // namespace moerun
