// The CUDA backend's entry points: defined by the CUDA implementation (cuda_device.cu,
// cuda_context.cc, cuda_layer_create.cc), compiled only in builds with CUDA (MOERUN_WITH_CUDA). The
// public interfaces that callers use (ProbeCuda in cuda_device.h; CudaRankContext::Create and
// CudaMoeLayer's factories in cuda_layer.h) are defined in cuda_backend.cc in every build: they
// call these where the build has CUDA, and otherwise say by name that it has no CUDA backend.
// So no stub stands in for the CUDA layer. Only layer/cuda includes this header.
#pragma once

#include <memory>

#include "base/status.h"
#include "runtime/layer/cuda/cuda_device.h"
#include "runtime/layer/cuda/cuda_layer.h"

namespace moerun::cuda_backend {

// The devices cudaGetDeviceCount sees (built = true), or why there are none.
CudaProbe Probe();
// The contracts of CudaRankContext::Create, CudaMoeLayer::Upload (the whole layer, and an expert
// rank's into `ctx`) and CudaMoeLayer::FromPreset (cuda_layer.h).
Result<std::shared_ptr<CudaRankContext>> CreateContext(const CudaLayerOptions& opts,
                                                       const cuda_plan::RankMemoryPlan& plan);
Result<std::unique_ptr<CudaMoeLayer>> Upload(const MoeLayerWeights& w,
                                             const CudaLayerOptions& opts);
Result<std::unique_ptr<CudaMoeLayer>> UploadTo(const MoeLayerWeights& w,
                                               std::shared_ptr<CudaRankContext> ctx);
Result<std::unique_ptr<CudaMoeLayer>> FromPreset(const ModelSpec& spec, const PresetOptions& preset,
                                                 const CudaLayerOptions& opts);

}  // namespace moerun::cuda_backend
