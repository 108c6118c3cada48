// Builds without CUDA: the same interface, every constructor says why it cannot run.
#include "layer/cuda/cuda_layer.h"

namespace moerun {
namespace {
Status NotBuilt() {
  return Status::Unsupported(
      "--device cuda: this build of moerun has no CUDA backend "
      "(configure with -DMOERUN_WITH_CUDA=ON where nvcc is installed)");
}
}  // namespace

const char* CudaMathName(CudaMath m) { return m == CudaMath::kExact ? "exact" : "tensor-core"; }

Result<std::shared_ptr<CudaRankContext>> CudaRankContext::Create(const CudaLayerOptions&,
                                                                 const cuda_plan::RankMemoryPlan&) {
  return NotBuilt();
}

Result<std::unique_ptr<CudaMoeLayer>> CudaMoeLayer::Upload(const MoeLayerWeights&,
                                                           const CudaLayerOptions&) {
  return NotBuilt();
}

Result<std::unique_ptr<CudaMoeLayer>> CudaMoeLayer::Upload(const MoeLayerWeights&,
                                                           std::shared_ptr<CudaRankContext>) {
  return NotBuilt();
}

Result<std::unique_ptr<CudaMoeLayer>> CudaMoeLayer::FromPreset(const ModelSpec&,
                                                               const PresetOptions&,
                                                               const CudaLayerOptions&) {
  return NotBuilt();
}

}  // namespace moerun
