// Loading new weights for one expert of one MoE layer from a .safetensors file (what
// `moectl expert update --layer L --expert E --from FILE` hands to a serving process).
//
// The file names its tensors as the model's checkpoint does (the names LoadLayer resolves, e.g.
// `model.layers.3.mlp.experts.5.gate_proj.weight`, `model.layers.3.block_sparse_moe.experts.5.w1
// .weight`; for gpt-oss and Step-3.5-Flash the stacked [experts, ...] tensors, of which only
// expert E is read). Only that expert's tensors are needed: no router, no shared expert. The
// expert is packed for `kernels` and held in `held`, the dtype of the serving layer's other experts
// (MoeLayerWeights::dtype), so it can run in the same GroupedFfn next to them; a file whose values
// `held` cannot hold exactly is refused rather than rounded. Every failure is a Status naming the
// file, layer, expert and (where one is at fault) the tensor. Thread-safe.
#pragma once

#include <string>

#include "base/dtype.h"
#include "base/status.h"
#include "experts/cpu/expert_weights.h"
#include "experts/cpu/kernels.h"
#include "runtime/model/model_spec.h"

namespace moerun {

Result<ExpertWeights> LoadExpertFile(const std::string& path, const ModelSpec& spec, int layer,
                                     int expert, DType held, const CpuKernels& kernels);

}  // namespace moerun
