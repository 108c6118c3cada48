// What `moerun forward` and `moebench layer` share: turning --model/--preset flags into a loaded
// MoE layer, with progress logged and every failure returned as a Status.
#pragma once

#include <memory>
#include <string>

#include "base/status.h"
#include "experts/cpu/kernels.h"
#include "runtime/model/layer_weights.h"

namespace moerun {

struct LayerFlags {
  std::string model;          // --model DIR
  std::string preset;         // --preset NAME
  uint64_t seed = 1;          // --seed
  int experts = 0;            // --experts (presets)
  int64_t intermediate = 0;   // --intermediate (presets): scaled expert intermediate size
  double gate_skew = 0.0;     // --gate-skew (presets): Zipf exponent of the routing
  std::string dtype = "f32";  // --dtype (presets): f32 | bf16 | f16 | fp8 | mxfp4
  int layer = -1;             // --layer
  int threads = 0;            // --threads (0: all cores)
  std::string isa;            // --isa (empty: best)
};

// Checks the flags that parse but make no sense (negative counts, absurd thread counts).
Status ValidateLayerFlags(const LayerFlags& f);

// Resolves --isa (or MOERUN_ISA); errors on unknown or unsupported names.
Result<Isa> ChooseIsa(const std::string& flag);
// --dtype: f32, bf16, f16, fp8 (F8_E4M3: 128 x 128 blocks) or mxfp4 (F4: 32-input groups).
Result<DType> ParseWeightDType(const std::string& name);

// The model's spec as the flags describe it (a preset's experts and intermediate size scaled as
// they say; a preset's note, if any, is logged), without loading any weights.
Result<ModelSpec> SpecFromFlags(const LayerFlags& f);

// Loads the layer named by the flags for `kernels`; logs progress for big layers.
Result<std::shared_ptr<const MoeLayerWeights>> LoadLayerFromFlags(const LayerFlags& f,
                                                                  const CpuKernels& kernels,
                                                                  int threads);

// "qwen3_moe layer 0: 16 experts top-4, hidden 64, F32 weights"
std::string DescribeLayer(const MoeLayerWeights& w);
std::string DescribeLayer(const ModelSpec& spec, int layer, DType dtype);  // before it is built
// The same with the weights' type named by the caller ("F32,F8_E4M3": one layer in several types).
std::string DescribeLayer(const ModelSpec& spec, int layer, const std::string& weights);

}  // namespace moerun
