// --device cuda for `moerun forward` and `moerun serve`: which GPU this rank uses (from its local
// rank, launch/local_device.h), which math, each rank's device memory plan (by role:
// runtime/layer/cuda/device_plan.h; what --plan-memory prints, and what the rank allocates), and
// the CUDA context and layers of an expert rank. Without a GPU (or without a CUDA build) the
// entries that need one return a clear error; the plans need none; the CPU path never comes here.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "base/status.h"
#include "router/placement.h"
#include "runtime/layer/cuda/cuda_layer.h"
#include "runtime/layer/cuda/device_plan.h"
#include "runtime/model/weight_source.h"
#include "runtime/ranks/rank_job.h"

namespace moerun {

struct DeviceFlags {
  std::string device = "cpu";  // cpu | cuda
  std::string math = "auto";   // auto (exact for f32 weights, tensor-core otherwise) | exact |
                               // tensor-core
  int device_index = -1;       // -1: local rank modulo the visible GPUs
  int64_t max_tokens = 8192;   // per forward (the device arena is sized for it)
};

// Adds --device, --math, --device-index and --max-tokens to a subcommand.
void AddDeviceFlags(CLI::App* cmd, DeviceFlags* f, const std::string& device_help,
                    const std::string& max_tokens_help);

// Checks --device/--math without touching a GPU.
Status ValidateDeviceFlags(const DeviceFlags& f);

// The math of weights of `dtype` (--math auto: exact for F32, else tensor cores: f16 for F16
// weights, bf16 otherwise) and --max-tokens; no GPU touched (device 0 until CudaOptionsFor).
CudaLayerOptions MathOptionsFor(const DeviceFlags& f, DType dtype);

// The layer options of this rank for weights of `dtype`: probes the GPUs, picks the local one and
// logs the choice (and when ranks share a GPU). `rank` only labels the log line.
Result<CudaLayerOptions> CudaOptionsFor(const DeviceFlags& f, DType dtype, int rank);

// The experts' weight type of a source without loading them: a preset's dtype; a checkpoint's
// quantization_config (FP8, MXFP4), else its torch_dtype (bfloat16, float16, float32).
Result<DType> SourceWeightType(const WeightSource& source, const ModelSpec& spec);

// The device memory plan of expert rank `rank`: its slots in each of `layers` from `placement`.
Result<cuda_plan::RankMemoryPlan> PlanExpertRank(const DeviceFlags& f, const ModelSpec& spec,
                                                 DType dtype, const std::vector<int>& layers,
                                                 const Placement& placement, int rank,
                                                 size_t expert_cache_bytes);

// A job to plan: ranks == 1 is the single-process forward (the whole layer on one GPU); else
// ranks [0, routers) are CPU routers and the others expert ranks.
struct MemoryPlanJob {
  std::string model;  // how the output names it: "preset deepseek-v3", a checkpoint folder
  ModelSpec spec;
  std::vector<int> layers;  // resolved MoE layers
  DType dtype = DType::kF32;
  int ranks = 1, routers = 1;
  std::string placement = "linear";
  size_t expert_cache_bytes = 0;
};
struct RankPlan {
  int rank = 0;
  cuda_plan::RankMemoryPlan plan;
};
Result<std::vector<RankPlan>> PlanJobMemory(const DeviceFlags& f, const MemoryPlanJob& job);

// --plan-memory: every rank's device bytes by region, as a table (ranks with the same plan
// share one) or as JSON. No GPU and no weights needed.
Result<std::string> FormatJobMemory(const DeviceFlags& f, const MemoryPlanJob& job, bool json);

// The job's rank count for --plan-memory: `flag` if > 0, else the MPI launcher's size from the
// environment, else `fallback`.
int PlanRanks(int flag, int fallback);

// An expert rank's grouped FFN on its GPU: ONE context (stream, arena, pinned tables) from the
// rank's plan, and one experts-only CUDA layer per loaded layer in it; the compute pins the
// rank's receive and send buffers.
Result<ExpertCompute> CudaExpertCompute(const DeviceFlags& f, int rank, const LoadedLayers& layers,
                                        const Placement& placement);

}  // namespace moerun
