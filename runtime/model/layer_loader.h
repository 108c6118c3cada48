// Loading one MoE layer's weights from a checkpoint, by the tensor names each family's published
// checkpoints use, into the packed form of one CPU kernel variant.
//
// Only the tensors of the requested layer (and of the requested experts) are touched. Every
// tensor is checked before use (runtime/model/tensor_source.h): present, a supported dtype (F32,
// BF16, F16; FP8 block-scaled with weight_scale_inv; MXFP4 blocks and scales), the shape the config
// implies, and for quantized ones their scales and codes. Packing runs on `threads` threads and
// reports progress through `progress` (may be empty).
//
// Experts are held in the checkpoint's type (F32 when a layer mixes plain dtypes) unless
// `hold_as` says otherwise: FP8 and MXFP4 experts stay quantized (1 and 0.5 byte a weight, plus
// scales); a conversion is made only where it is exact (widening to F32; FP8 rounds once), and
// narrowing only if every value fits the narrower type exactly (otherwise an error names the
// tensor and the value). A quantized hold_as takes only weights stored in that format.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "experts/cpu/kernels.h"
#include "runtime/model/checkpoint.h"
#include "runtime/model/layer_weights.h"
#include "runtime/model/model_spec.h"

namespace moerun {

struct LoadOptions {
  int layer = -1;                 // -1: the first MoE layer
  std::vector<bool> load_expert;  // empty: all experts
  // Only the routed experts: router, router bias, selection bias and shared expert are neither
  // read nor required, and stay empty in the result.
  bool experts_only = false;
  // The dtype to hold the experts (and shared expert) in; nullopt: the checkpoint's.
  std::optional<DType> hold_as;
  int threads = 1;
  // Called after each expert with (experts done, experts to load, bytes packed so far).
  std::function<void(int, int, size_t)> progress;
};

Result<MoeLayerWeights> LoadLayer(const Checkpoint& ckpt, const ModelSpec& spec,
                                  const CpuKernels& kernels, const LoadOptions& opts);

// Resolves --layer: -1 -> first MoE layer; otherwise must be an MoE layer of the spec.
Result<int> ResolveMoeLayer(const ModelSpec& spec, int layer);

}  // namespace moerun
