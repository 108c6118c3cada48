#include "launch/cuda_setup.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "base/log.h"
#include "launch/local_device.h"
#include "runtime/ep/protocol.h"
#include "runtime/layer/cuda/cuda_device.h"
#include "runtime/layer/cuda/device_weights.h"
#include "runtime/model/preset.h"

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

CudaLayerOptions MathOptionsFor(const DeviceFlags& f, DType dtype) {
  CudaLayerOptions o;
  o.max_tokens = f.max_tokens;
  o.math = f.math == "exact"         ? CudaMath::kExact
           : f.math == "tensor-core" ? CudaMath::kTensorCore
           : dtype == DType::kF32    ? CudaMath::kExact
                                     : CudaMath::kTensorCore;
  if (o.math == CudaMath::kTensorCore)
    o.mma_type = dtype == DType::kF16 ? DType::kF16 : DType::kBF16;
  return o;
}

Result<CudaLayerOptions> CudaOptionsFor(const DeviceFlags& f, DType dtype, int rank) {
  MOERUN_RETURN_IF_ERROR(ValidateDeviceFlags(f));
  MOERUN_ASSIGN_OR_RETURN(const CudaProbe probe, RequireCuda());
  const LocalDeviceChoice choice = ChooseLocalDevice(
      ProcessEnvironment(), static_cast<int>(probe.devices.size()), f.device_index);
  if (!choice.ok()) return choice.error;
  CudaLayerOptions o = MathOptionsFor(f, dtype);
  o.device = choice.device;
  spdlog::info("rank {}: {} ({}), {} math{}", rank, choice.Describe(),
               probe.devices[static_cast<size_t>(choice.device)].name, CudaMathName(o.math),
               choice.shared ? fmt::format("; {} local ranks share this GPU: device data moves "
                                           "host-staged (NCCL refuses shared GPUs)",
                                           choice.ranks_sharing_device)
                             : std::string());
  return o;
}

Result<DType> SourceWeightType(const WeightSource& source, const ModelSpec& spec) {
  if (source.model.empty()) return source.dtype;
  switch (spec.quant.method) {
    case QuantMethod::kFp8:
      return DType::kF8E4M3;
    case QuantMethod::kMxfp4:
      return DType::kF4;
    case QuantMethod::kNone:
      break;
  }
  if (spec.torch_dtype == "bfloat16") return DType::kBF16;
  if (spec.torch_dtype == "float16") return DType::kF16;
  if (spec.torch_dtype == "float32" || spec.torch_dtype.empty()) return DType::kF32;
  return Status::InvalidArgument("--plan-memory: the checkpoint's torch_dtype '" +
                                 spec.torch_dtype + "' is not bfloat16, float16 or float32");
}

namespace {

// The parts of a plan's input that every role shares.
Result<cuda_plan::RankMemoryInput> BaseInput(const DeviceFlags& f, const ModelSpec& spec,
                                             DType dtype) {
  MOERUN_RETURN_IF_ERROR(ValidateDeviceFlags(f));
  const CudaLayerOptions o = MathOptionsFor(f, dtype);
  cuda_plan::RankMemoryInput in;
  MOERUN_ASSIGN_OR_RETURN(
      in.format, cuda_plan::ChooseWeightFormat(dtype, o.math == CudaMath::kTensorCore, o.mma_type));
  in.hidden = spec.hidden;
  in.expert_inter = spec.expert_inter;
  in.top_k = spec.top_k;
  in.experts = spec.num_experts;
  in.gate_rows = spec.num_experts + (spec.shared_gated ? 1 : 0);
  in.expert_bias = spec.expert_bias;
  in.tensor_cores = o.math == CudaMath::kTensorCore;
  in.max_tokens = f.max_tokens;
  in.graph_max_tokens = o.graph_max_tokens;
  return in;
}

}  // namespace

Result<cuda_plan::RankMemoryPlan> PlanExpertRank(const DeviceFlags& f, const ModelSpec& spec,
                                                 DType dtype, const std::vector<int>& layers,
                                                 const Placement& placement, int rank,
                                                 size_t expert_cache_bytes) {
  MOERUN_ASSIGN_OR_RETURN(cuda_plan::RankMemoryInput in, BaseInput(f, spec, dtype));
  in.role = cuda_plan::DeviceRole::kExpertRank;
  in.routers = placement.num_routers();
  in.result_trailer_bytes = sizeof(EpResultTrailer);
  in.expert_cache_bytes = expert_cache_bytes;
  for (int layer : layers) {
    const LayerPlacement* lp = placement.Layer(layer);
    if (lp == nullptr) {
      return Status::InvalidArgument(fmt::format("the placement has no entry for layer {}", layer));
    }
    cuda_plan::HostedLayer h;
    h.layer = layer;
    h.slots = rank < static_cast<int>(lp->rank_slots.size())
                  ? static_cast<int>(lp->rank_slots[static_cast<size_t>(rank)].size())
                  : 0;
    for (bool hosted : placement.ExpertsOf(rank, layer)) h.experts += hosted;
    in.layers.push_back(h);
  }
  return cuda_plan::PlanRankMemory(in);
}

Result<std::vector<RankPlan>> PlanJobMemory(const DeviceFlags& f, const MemoryPlanJob& job) {
  std::vector<RankPlan> out;
  if (job.layers.empty()) return Status::InvalidArgument("--plan-memory: no MoE layer to plan");
  if (job.ranks == 1) {  // one process: the whole layer (one layer: forward's)
    if (job.layers.size() != 1) {
      return Status::InvalidArgument("--plan-memory: one process holds one whole layer");
    }
    MOERUN_ASSIGN_OR_RETURN(cuda_plan::RankMemoryInput in, BaseInput(f, job.spec, job.dtype));
    in.role = cuda_plan::DeviceRole::kWholeLayer;
    in.shared_inter = job.spec.shared_inter;
    in.gate_bias = job.spec.router_bias;
    in.selection_bias = job.spec.gate.selection_bias;
    in.layers = {cuda_plan::HostedLayer{job.layers[0], job.spec.num_experts, job.spec.num_experts}};
    MOERUN_ASSIGN_OR_RETURN(auto plan, cuda_plan::PlanRankMemory(in));
    out.push_back(RankPlan{0, std::move(plan)});
    return out;
  }
  if (job.routers < 1 || job.ranks <= job.routers) {
    return Status::InvalidArgument(
        fmt::format("--plan-memory: {} ranks with {} routers leaves no expert rank (ranks must "
                    "be more than routers)",
                    job.ranks, job.routers));
  }
  MOERUN_ASSIGN_OR_RETURN(
      const Placement placement,
      Placement::Make(job.placement, job.spec.num_experts, job.ranks, job.routers));
  for (int r = 0; r < job.ranks; ++r) {
    RankPlan rp;
    rp.rank = r;
    if (r < job.routers) {
      cuda_plan::RankMemoryInput in;
      in.role = cuda_plan::DeviceRole::kCpuRouter;
      MOERUN_ASSIGN_OR_RETURN(rp.plan, cuda_plan::PlanRankMemory(in));
    } else {
      MOERUN_ASSIGN_OR_RETURN(rp.plan, PlanExpertRank(f, job.spec, job.dtype, job.layers, placement,
                                                      r, job.expert_cache_bytes));
    }
    out.push_back(std::move(rp));
  }
  return out;
}

namespace {

std::string RankList(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!s.empty()) s += ",";
    s += j == i ? std::to_string(ranks[i]) : fmt::format("{}-{}", ranks[i], ranks[j]);
    i = j + 1;
  }
  return s;
}

nlohmann::json PlanJson(const RankPlan& rp) {
  const cuda_plan::RankMemoryPlan& p = rp.plan;
  nlohmann::json regions = nlohmann::json::array();
  for (const auto& w : p.weights) {
    regions.push_back({{"name", w.name}, {"bytes", w.bytes}, {"kind", "weights"}});
  }
  for (const auto& r : p.arena.regions) {
    nlohmann::json j = {
        {"name", r.name}, {"bytes", r.bytes}, {"offset", r.offset}, {"kind", "arena"}};
    if (!r.alias_of.empty()) j["alias_of"] = r.alias_of;
    regions.push_back(j);
  }
  return {{"rank", rp.rank},
          {"role", cuda_plan::DeviceRoleName(p.role)},
          {"device_bytes", p.device_total()},
          {"weight_bytes", p.weight_bytes()},
          {"non_weight_bytes", p.non_weight_bytes()},
          {"pinned_host_bytes", p.pinned_host},
          {"max_rows", p.max_rows},
          {"graph_buckets", p.graph_buckets},
          {"regions", regions}};
}

}  // namespace

Result<std::string> FormatJobMemory(const DeviceFlags& f, const MemoryPlanJob& job, bool json) {
  MOERUN_ASSIGN_OR_RETURN(const std::vector<RankPlan> plans, PlanJobMemory(f, job));
  // Tensor cores multiply f16 only for f16 weights (quantized weights decode to bf16).
  const CudaLayerOptions o = MathOptionsFor(f, job.dtype);
  const bool f16 = plans.back().plan.format == cuda_plan::WeightFormat::kF16;
  const std::string math = o.math == CudaMath::kExact ? std::string("exact")
                           : f16                      ? std::string("tensor-core f16")
                                                      : std::string("tensor-core bf16");
  if (json) {
    nlohmann::json doc = {{"model", job.model},
                          {"family", FamilyName(job.spec.family)},
                          {"layers", job.layers.size()},
                          {"ranks", job.ranks},
                          {"routers", job.ranks == 1 ? 0 : job.routers},
                          {"max_tokens", f.max_tokens},
                          {"weights", DTypeName(job.dtype)},
                          {"math", math},
                          {"plans", nlohmann::json::array()}};
    for (const auto& rp : plans) doc["plans"].push_back(PlanJson(rp));
    return doc.dump(2) + "\n";
  }
  std::string s = fmt::format(
      "device memory plan: {} ({}) | {} MoE layer{} | {} experts top-{} hidden {} | {} weights, {} "
      "math | --max-tokens {} | {}\n",
      job.model, FamilyName(job.spec.family), job.layers.size(), job.layers.size() == 1 ? "" : "s",
      job.spec.num_experts, job.spec.top_k, job.spec.hidden, DTypeName(job.dtype), math,
      f.max_tokens,
      job.ranks == 1
          ? std::string("one process: the whole layer on one GPU")
          : fmt::format("{} ranks: {} router{}, {} expert rank{}", job.ranks, job.routers,
                        job.routers == 1 ? "" : "s", job.ranks - job.routers,
                        job.ranks - job.routers == 1 ? "" : "s"));
  // Ranks with the same plan share one table.
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  std::map<std::string, const RankPlan*> first;
  for (const auto& rp : plans) {
    const std::string table = cuda_plan::DescribeRankMemory(rp.plan);
    const std::string key = std::string(cuda_plan::DeviceRoleName(rp.plan.role)) + "\n" + table;
    auto it =
        std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
    if (it == groups.end()) {
      groups.emplace_back(key, std::vector<int>{rp.rank});
      first[key] = &rp;
    } else {
      it->second.push_back(rp.rank);
    }
  }
  for (const auto& [key, ranks] : groups) {
    const cuda_plan::RankMemoryPlan& p = first[key]->plan;
    s += fmt::format("\nrank{} {} ({}): {:.2f} GiB on the device, {:.2f} GiB of it not weights\n",
                     ranks.size() == 1 ? "" : "s", RankList(ranks),
                     cuda_plan::DeviceRoleName(p.role),
                     static_cast<double>(p.device_total()) / (1 << 30),
                     static_cast<double>(p.non_weight_bytes()) / (1 << 30));
    s += cuda_plan::DescribeRankMemory(p);
  }
  return s;
}

int PlanRanks(int flag, int fallback) {
  if (flag > 0) return flag;
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && std::atoi(v) > 0) return std::atoi(v);
  }
  return fallback;
}

Result<ExpertCompute> CudaExpertCompute(const DeviceFlags& f, int rank, const LoadedLayers& layers,
                                        const Placement& placement) {
  if (layers.empty()) return Status::InvalidArgument("--device cuda: the rank loaded no layer");
  const MoeLayerWeights& any = *layers.begin()->second;
  std::vector<int> numbers;
  for (const auto& [number, w] : layers) {
    if (w->dtype != any.dtype) {
      return Status::InvalidArgument(
          fmt::format("--device cuda: layers of one rank must share a weight type ({} and {})",
                      DTypeName(w->dtype), DTypeName(any.dtype)));
    }
    numbers.push_back(number);
  }
  // One context for every layer of the rank, laid out by the rank's plan.
  MOERUN_ASSIGN_OR_RETURN(const cuda_plan::RankMemoryPlan plan,
                          PlanExpertRank(f, any.spec, any.dtype, numbers, placement, rank, 0));
  MOERUN_ASSIGN_OR_RETURN(const CudaLayerOptions o, CudaOptionsFor(f, any.dtype, rank));
  MOERUN_ASSIGN_OR_RETURN(std::shared_ptr<CudaRankContext> ctx, CudaRankContext::Create(o, plan));
  auto on_gpu = std::make_shared<std::map<int, std::unique_ptr<CudaMoeLayer>>>();
  for (const auto& [number, w] : layers) {
    MOERUN_ASSIGN_OR_RETURN(auto layer, CudaMoeLayer::Upload(*w, ctx));
    (*on_gpu)[number] = std::move(layer);
  }
  spdlog::info(
      "rank {}: {} layer{} of experts on {}; {:.2f} GiB weights, {:.2f} GiB arena, "
      "{:.2f} GiB pinned host at most",
      rank, layers.size(), layers.size() == 1 ? "" : "s", ctx->Describe(),
      static_cast<double>(plan.weight_bytes()) / (1 << 30),
      static_cast<double>(plan.non_weight_bytes()) / (1 << 30),
      static_cast<double>(plan.pinned_host) / (1 << 30));
  HostPinning pin;
  pin.pin = [ctx](void* p, size_t bytes) { return ctx->PinHost(p, bytes); };
  pin.unpin = [ctx](void* p) { ctx->UnpinHost(p); };
  return ExpertCompute(
      [on_gpu](int layer, const float* rows, const std::vector<int32_t>& group_expert,
               const std::vector<int64_t>& group_rows, float* y) -> Status {
        auto it = on_gpu->find(layer);
        if (it == on_gpu->end()) {
          return Status::Internal(fmt::format("layer {} is not on this rank's GPU", layer));
        }
        return it->second->RunExperts(rows, group_expert, group_rows, y);
      },
      std::move(pin));
}

}  // namespace moerun
