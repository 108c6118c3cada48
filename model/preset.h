// Presets: a real model's MoE layer shape with random weights made from a seed.
//
// The weights are a pure function of (seed, layer, tensor, row, column): every machine and every
// process gets the same values, and a rank generates only the experts it hosts, straight into
// packed form (nothing is written to disk). By default a preset keeps as many experts as fit in
// 4 GB of expert weights (and says so); --experts N overrides. Thread-safe.
#pragma once

#include <string>
#include <vector>

#include "experts/cpu/kernels.h"
#include "model/layer_weights.h"
#include "model/model_spec.h"

namespace moerun {

struct PresetOptions {
  uint64_t seed = 1;
  int experts = 0;            // 0: as many as fit in `budget_bytes` (at most the real count)
  DType dtype = DType::kF32;  // F32, BF16 or F16 expert weights
  int layer = -1;             // -1: the first MoE layer
  size_t budget_bytes = size_t{4} << 30;
  std::vector<bool> load_expert;  // empty: all
  // Skewed routing on demand: a Zipf exponent over experts. Expert e's router logit gets
  // -gate_skew * ln(e + 1) added (a router bias), so low-numbered experts take most tokens, as in
  // real traffic. 0: unskewed. In [0, 8].
  double gate_skew = 0.0;
  int threads = 1;
  std::function<void(int, int, size_t)> progress;
};

std::vector<std::string> PresetNames();
// The full-size spec of a preset (as in the model's published config.json).
Result<ModelSpec> PresetFullSpec(const std::string& name);
// The spec actually built: experts scaled to the budget (a note says so) or to opts.experts.
Result<ModelSpec> PresetSpec(const std::string& name, const PresetOptions& opts, std::string* note);

// Builds the layer's weights. `spec` comes from PresetSpec.
Result<MoeLayerWeights> BuildPresetLayer(const ModelSpec& spec, const CpuKernels& kernels,
                                         const PresetOptions& opts);

// The value of element (row, col) of a preset tensor (for tests and the reference loop).
// tensor: 0 router, 1 gate, 2 up, 3 down, 4 selection bias, 5 router bias, 6/7/8 biases g/u/d,
// 9 shared-expert gate; expert -1 is the shared expert.
float PresetValue(uint64_t seed, int layer, int tensor, int expert, int64_t row, int64_t col,
                  int64_t fan_in, DType dtype);

}  // namespace moerun
