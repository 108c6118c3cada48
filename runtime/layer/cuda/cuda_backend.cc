// The public entry points of the CUDA layer and the device probe (cuda_device.h, cuda_layer.h),
// in every build: with CUDA they are the backend's (cuda_backend.h); without it each says that
// this build has no CUDA backend, and how to build one.
#include "runtime/layer/cuda/cuda_backend.h"

#include <utility>

#include "moerun/build_info.h"

namespace moerun {
namespace {

#if !MOERUN_HAVE_CUDA
Status LayerNotBuilt() {
  return Status::Unsupported(
      "--device cuda: this build of moerun has no CUDA backend "
      "(configure with -DMOERUN_WITH_CUDA=ON where nvcc is installed)");
}
#endif

}  // namespace

const char* CudaMathName(CudaMath m) { return m == CudaMath::kExact ? "exact" : "tensor-core"; }

CudaProbe ProbeCuda() {
#if MOERUN_HAVE_CUDA
  return cuda_backend::Probe();
#else
  CudaProbe p;
  p.error =
      "this build of moerun has no CUDA support (configure with MOERUN_WITH_CUDA=ON on a "
      "machine with the CUDA toolkit)";
  return p;
#endif
}

Result<std::shared_ptr<CudaRankContext>> CudaRankContext::Create(
    const CudaLayerOptions& opts, const cuda_plan::RankMemoryPlan& plan) {
#if MOERUN_HAVE_CUDA
  return cuda_backend::CreateContext(opts, plan);
#else
  (void)opts, (void)plan;
  return LayerNotBuilt();
#endif
}

Result<std::unique_ptr<CudaMoeLayer>> CudaMoeLayer::Upload(const MoeLayerWeights& w,
                                                           const CudaLayerOptions& opts) {
#if MOERUN_HAVE_CUDA
  return cuda_backend::Upload(w, opts);
#else
  (void)w, (void)opts;
  return LayerNotBuilt();
#endif
}

Result<std::unique_ptr<CudaMoeLayer>> CudaMoeLayer::Upload(const MoeLayerWeights& w,
                                                           std::shared_ptr<CudaRankContext> ctx) {
#if MOERUN_HAVE_CUDA
  return cuda_backend::UploadTo(w, std::move(ctx));
#else
  (void)w, (void)ctx;
  return LayerNotBuilt();
#endif
}

Result<std::unique_ptr<CudaMoeLayer>> CudaMoeLayer::FromPreset(const ModelSpec& spec,
                                                               const PresetOptions& preset,
                                                               const CudaLayerOptions& opts) {
#if MOERUN_HAVE_CUDA
  return cuda_backend::FromPreset(spec, preset, opts);
#else
  (void)spec, (void)preset, (void)opts;
  return LayerNotBuilt();
#endif
}

}  // namespace moerun
