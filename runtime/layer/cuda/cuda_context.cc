// ContextImpl (cuda_layer_impl.h): a rank's device state, made once from its memory plan and shared
// by every layer the rank holds; and the backend's CreateContext entry point.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "runtime/layer/cuda/cuda_backend.h"
#include "runtime/layer/cuda/cuda_layer_impl.h"
#include "runtime/layer/cuda/kernel_check.h"

namespace moerun {
namespace cuda_impl {

Status CudaError(const char* what, cudaError_t e) {
  return Status::Internal(
      fmt::format("CUDA: {}: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

ContextImpl::~ContextImpl() {
  if (!initialised_) return;
  cudaSetDevice(opts_.device);
  cudaStreamSynchronize(stream_);
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  for (void* p : pinned_) cudaHostUnregister(p);
  if (arena_ != nullptr) cudaFree(arena_);
  if (host_ != nullptr) cudaFreeHost(host_);
  if (ev0_ != nullptr) cudaEventDestroy(ev0_);
  if (ev1_ != nullptr) cudaEventDestroy(ev1_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

Status ContextImpl::Init() {
  if (plan_.role == cuda_plan::DeviceRole::kCpuRouter) {
    return Status::InvalidArgument("CUDA context: a CPU router's plan holds no device memory");
  }
  if (plan_.tensor_cores != (opts_.math == CudaMath::kTensorCore)) {
    return Status::Internal("CUDA context: the memory plan is for another math");
  }
  if (opts_.max_tokens < 1 || opts_.max_tokens > (int64_t{1} << 20)) {
    return Status::InvalidArgument("CUDA layer: max_tokens must be in 1..1048576");
  }
  int count = 0;
  const cudaError_t probe = cudaGetDeviceCount(&count);
  if (probe != cudaSuccess || count == 0) {
    cudaGetLastError();
    return Status::Unavailable(
        fmt::format("--device cuda: no usable GPU ({})",
                    probe != cudaSuccess ? cudaGetErrorString(probe) : "no CUDA device"));
  }
  if (opts_.device < 0 || opts_.device >= count) {
    return Status::InvalidArgument(
        fmt::format("CUDA device {} does not exist ({} visible)", opts_.device, count));
  }
  MOERUN_CUDA_TRY(cudaSetDevice(opts_.device));
  cudaDeviceProp prop{};
  MOERUN_CUDA_TRY(cudaGetDeviceProperties(&prop, opts_.device));
  device_name_ = prop.name;
  sm_ = prop.major * 10 + prop.minor;
  if (opts_.math == CudaMath::kTensorCore && prop.major < 8) {
    return Status::Unsupported(fmt::format(
        "CUDA layer: tensor-core math needs sm_80 or newer ({} is sm_{})", prop.name, sm_));
  }
  MOERUN_RETURN_IF_ERROR(CheckKernelImagesFor(opts_.device));
  initialised_ = true;
  MOERUN_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  MOERUN_CUDA_TRY(cudaEventCreate(&ev0_));
  MOERUN_CUDA_TRY(cudaEventCreate(&ev1_));
  // The arena: exactly the plan's (aliases share their region's bytes).
  const size_t arena_bytes = std::max<size_t>(plan_.arena.total, 256);
  void* a = nullptr;
  if (const cudaError_t e = cudaMalloc(&a, arena_bytes); e != cudaSuccess) {
    cudaGetLastError();
    return Status::ResourceExhausted(fmt::format(
        "CUDA: allocating the rank's {:.1f} MiB arena on {}: {}",
        static_cast<double>(arena_bytes) / (1 << 20), device_name_, cudaGetErrorString(e)));
  }
  arena_ = static_cast<uint8_t*>(a);
  void* h = nullptr;
  MOERUN_CUDA_TRY(cudaMallocHost(&h, std::max<size_t>(plan_.pinned_tables, 64)));
  host_ = static_cast<uint8_t*>(h);
  const auto g1 = static_cast<size_t>(plan_.max_groups + 1);
  tables_.flags = reinterpret_cast<int32_t*>(host_);
  tables_.row_off = reinterpret_cast<int32_t*>(host_ + 64);
  tables_.tile_off = tables_.row_off + g1;
  tables_.groups = reinterpret_cast<DevGroup*>(host_ + 64 + 8 * g1);
  if (64 + 8 * g1 + g1 * sizeof(DevGroup) > plan_.pinned_tables) {
    return Status::Internal("CUDA context: the plan's pinned tables are too small");
  }
  return Status::Ok();
}

Status ContextImpl::PinHost(void* p, size_t bytes) {
  if (p == nullptr || bytes == 0 || pinned_.count(p) != 0) return Status::Ok();
  MOERUN_CUDA_TRY(cudaSetDevice(opts_.device));
  const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
  if (e == cudaErrorHostMemoryAlreadyRegistered) {
    // Page-locked already by its other user (the nccl transport's RegisterMemory): pinned all
    // the same, and that user unregisters it, so it is not ours to release.
    cudaGetLastError();
    return Status::Ok();
  }
  MOERUN_CUDA_TRY(e);
  pinned_.insert(p);
  return Status::Ok();
}

void ContextImpl::UnpinHost(void* p) {
  if (pinned_.erase(p) == 0) return;
  cudaSetDevice(opts_.device);
  cudaStreamSynchronize(stream_);  // no copy from or to it is left in flight
  cudaHostUnregister(p);
}

std::string ContextImpl::Describe() const {
  return fmt::format("{} (sm_{}, device {}), {} role, {} math, {}", device_name_, sm_, opts_.device,
                     cuda_plan::DeviceRoleName(plan_.role), CudaMathName(opts_.math),
                     plan_.arena.Describe());
}

uint8_t* ContextImpl::Region(const std::string& name) const {
  const cuda_plan::ArenaPlan::Region* r = plan_.arena.Find(name);
  return r == nullptr ? nullptr : arena_ + r->offset;
}

Status ContextImpl::AddWeights(size_t bytes) {
  weights_ += bytes;
  const size_t planned = plan_.weight_bytes();
  if (weights_ > planned) {
    return Status::Internal(fmt::format(
        "CUDA context: the layers hold {} weight bytes, the memory plan {}", weights_, planned));
  }
  return Status::Ok();
}

void ContextImpl::DropGraphs(const void* owner) {
  for (auto it = graphs_.begin(); it != graphs_.end();) {
    if (it->first.first == owner) {
      cudaGraphExecDestroy(it->second);
      it = graphs_.erase(it);
    } else {
      ++it;
    }
  }
}

Result<std::shared_ptr<ContextImpl>> MakeContext(const CudaLayerOptions& opts,
                                                 cuda_plan::RankMemoryPlan plan) {
  auto ctx = std::make_shared<ContextImpl>(opts, std::move(plan));
  MOERUN_RETURN_IF_ERROR(ctx->Init());
  return ctx;
}

}  // namespace cuda_impl

// The CUDA backend's entry points (cuda_backend.h); cuda_backend.cc forwards the public ones here.
Result<std::shared_ptr<CudaRankContext>> cuda_backend::CreateContext(
    const CudaLayerOptions& opts, const cuda_plan::RankMemoryPlan& plan) {
  MOERUN_ASSIGN_OR_RETURN(auto ctx, cuda_impl::MakeContext(opts, plan));
  spdlog::info("cuda: {}", ctx->Describe());
  return std::shared_ptr<CudaRankContext>(std::move(ctx));
}

}  // namespace moerun
