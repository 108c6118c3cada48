#include "launch/cuda_setup.h"

#include <fmt/format.h>

#include <memory>

#include "base/log.h"
#include "launch/local_device.h"
#include "layer/cuda/cuda_device.h"

namespace moerun {

Status ValidateDeviceFlags(const DeviceFlags& f) {
  if (f.device != "cpu" && f.device != "cuda") {
    return Status::InvalidArgument("--device must be cpu or cuda, not '" + f.device + "'");
  }
  if (f.math != "auto" && f.math != "exact" && f.math != "tensor-core") {
    return Status::InvalidArgument("--math must be auto, exact or tensor-core, not '" + f.math +
                                   "'");
  }
  if (f.device_index < -1) return Status::InvalidArgument("--device-index must be >= 0");
  if (f.max_tokens < 1 || f.max_tokens > (int64_t{1} << 20)) {
    return Status::InvalidArgument("--max-tokens must be in 1..1048576");
  }
  return Status::Ok();
}

void AddDeviceFlags(CLI::App* cmd, DeviceFlags* f, const std::string& device_help,
                    const std::string& max_tokens_help) {
  cmd->add_option("--device", f->device, device_help)->default_val("cpu");
  cmd->add_option("--math", f->math,
                  "--device cuda: auto (exact for f32 weights, else tensor-core), exact (fp32, "
                  "bitwise the CPU), tensor-core (bf16/f16)")
      ->default_val("auto");
  cmd->add_option("--device-index", f->device_index,
                  "--device cuda: GPU ordinal (default: local rank modulo the visible GPUs)");
  cmd->add_option("--max-tokens", f->max_tokens, max_tokens_help)->default_val(8192);
}

Result<CudaLayerOptions> CudaOptionsFor(const DeviceFlags& f, DType dtype, int rank) {
  MOERUN_RETURN_IF_ERROR(ValidateDeviceFlags(f));
  MOERUN_ASSIGN_OR_RETURN(const CudaProbe probe, RequireCuda());
  const LocalDeviceChoice choice = ChooseLocalDevice(
      ProcessEnvironment(), static_cast<int>(probe.devices.size()), f.device_index);
  if (!choice.ok()) return choice.error;
  CudaLayerOptions o;
  o.device = choice.device;
  o.max_tokens = f.max_tokens;
  o.math = f.math == "exact"         ? CudaMath::kExact
           : f.math == "tensor-core" ? CudaMath::kTensorCore
           : dtype == DType::kF32    ? CudaMath::kExact
                                     : CudaMath::kTensorCore;
  if (o.math == CudaMath::kTensorCore)
    o.mma_type = dtype == DType::kF16 ? DType::kF16 : DType::kBF16;
  spdlog::info("rank {}: {} ({}), {} math{}", rank, choice.Describe(),
               probe.devices[static_cast<size_t>(choice.device)].name, CudaMathName(o.math),
               choice.shared ? fmt::format("; {} local ranks share this GPU: device data moves "
                                           "host-staged (NCCL refuses shared GPUs)",
                                           choice.ranks_sharing_device)
                             : std::string());
  return o;
}

Result<ExpertCompute> CudaExpertCompute(const DeviceFlags& f, int rank,
                                        const LoadedLayers& layers) {
  auto on_gpu = std::make_shared<std::map<int, std::unique_ptr<CudaMoeLayer>>>();
  for (const auto& [number, w] : layers) {
    MOERUN_ASSIGN_OR_RETURN(CudaLayerOptions o, CudaOptionsFor(f, w->dtype, rank));
    MOERUN_ASSIGN_OR_RETURN(auto layer, CudaMoeLayer::Upload(*w, o));
    spdlog::info("rank {} layer {}: experts on {}", rank, number, layer->Describe());
    (*on_gpu)[number] = std::move(layer);
  }
  return ExpertCompute([on_gpu](int layer, const float* rows,
                                const std::vector<int32_t>& group_expert,
                                const std::vector<int64_t>& group_rows, float* y) -> Status {
    auto it = on_gpu->find(layer);
    if (it == on_gpu->end()) {
      return Status::Internal(fmt::format("layer {} is not on this rank's GPU", layer));
    }
    return it->second->RunExperts(rows, group_expert, group_rows, y);
  });
}

}  // namespace moerun
