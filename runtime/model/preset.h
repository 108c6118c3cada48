// Presets: a real model's MoE layer shape with random weights made from a seed.
//
// The weights are a pure function of (seed, layer, tensor, row, column): every machine and every
// process gets the same values, and a rank generates only the experts it hosts, straight into
// packed form (nothing is written to disk). By default a preset keeps as many experts as fit in
// 4 GB of expert weights as they are held (FP8 and MXFP4 count their codes and scales, so they
// keep more experts) and says so; --experts N overrides. `intermediate` scales the experts'
// intermediate size down (a whole model's layers on a small machine), the shared expert's by the
// same factor; everything else (hidden size, top-k, groups, layers) keeps the real shape.
// Thread-safe.
//
// FP8 and MXFP4 weights are the random values quantized the way real checkpoints are made; the
// router stays F32, and the shared expert takes the routed experts' type (as in DeepSeek-V3's FP8
// checkpoint):
//   FP8 (F8_E4M3): per 128 x 128 block of each expert matrix W [out][in], scale_inv = amax / 448
//                  (amax: the block's largest |value|; 1 if it is 0), code = e4m3(value / scale).
//   MXFP4 (F4):    per output row and 32 inputs, scale = 2^(floor(log2(amax)) - 2) (the OCP MX
//                  rule: 2 is e2m1's largest exponent; the exponent clamped to [-127, 127]; 1 if
//                  amax is 0, where every code is 0 anyway), code = e2m1(value / scale).
// Codes round to nearest even and saturate (base/quant_formats.h).
#pragma once

#include <string>
#include <vector>

#include "experts/cpu/kernels.h"
#include "runtime/model/layer_weights.h"
#include "runtime/model/model_spec.h"

namespace moerun {

struct PresetOptions {
  uint64_t seed = 1;
  int experts = 0;  // 0: as many as fit in `budget_bytes` (at most the real count)
  // 0: the model's expert intermediate size; else this one: a multiple of 32 (MXFP4's group of
  // inputs), at most the model's. A shared expert is scaled by the same factor (a multiple of 32,
  // at least 32).
  int64_t intermediate = 0;
  DType dtype = DType::kF32;  // expert weights: F32, BF16, F16, F8_E4M3 (FP8) or F4 (MXFP4)
  int layer = -1;             // -1: the first MoE layer
  size_t budget_bytes = size_t{4} << 30;
  std::vector<bool> load_expert;  // empty: all
  bool experts_only = false;      // the routed experts alone: no router, biases or shared expert
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
// The spec actually built: experts scaled to the budget (a note says so) or to opts.experts, and
// the intermediate sizes to opts.intermediate.
Result<ModelSpec> PresetSpec(const std::string& name, const PresetOptions& opts, std::string* note);

// Sets spec's expert intermediate size to `inter` and scales its shared expert's by the same
// factor (PresetOptions::intermediate; 0 changes nothing). kInvalidArgument, naming the model's
// size, for a size that is not a multiple of 32 in [32, the model's].
Status ScaleIntermediate(const std::string& name, int64_t inter, ModelSpec* spec);

// Builds the layer's weights. `spec` comes from PresetSpec.
Result<MoeLayerWeights> BuildPresetLayer(const ModelSpec& spec, const CpuKernels& kernels,
                                         const PresetOptions& opts);

// The value of element (row, col) of a preset tensor (for tests), rounded to `dtype` (F32, BF16,
// F16; for FP8 and MXFP4 the value before quantization: the weight needs its whole block).
// tensor: 0 router, 1 gate, 2 up, 3 down, 4 selection bias, 5 router bias, 6/7/8 biases g/u/d,
// 9 shared-expert gate; expert -1 is the shared expert.
float PresetValue(uint64_t seed, int layer, int tensor, int expert, int64_t row, int64_t col,
                  int64_t fan_in, DType dtype);

// The quantization rules above, as presets apply them (exposed for tests).
// The FP8 scale_inv of a block whose largest |value| is `amax`; the MXFP4 scale of a group.
float PresetFp8Scale(float amax);
float PresetMxfp4Scale(float amax);
// F32ToE4m3 and F32ToE2m1 (base/quant_formats.h) by bit arithmetic instead of a search: the same
// code for every float, a good deal faster (presets convert billions of values).
uint8_t PresetE4m3Code(float v);
uint8_t PresetE2m1Code(float v);

}  // namespace moerun
