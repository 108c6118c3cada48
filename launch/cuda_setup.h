// --device cuda for `moerun forward` and `moerun serve`: which GPU this rank uses (from its local
// rank, launch/local_device.h), which math, and the CUDA layers of an expert rank. Without a GPU
// (or without a CUDA build) every entry returns a clear error; the CPU path never comes here.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "base/status.h"
#include "layer/cuda/cuda_layer.h"
#include "ranks/rank_job.h"

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

// The layer options of this rank for weights of `dtype`: probes the GPUs, picks the local one and
// logs the choice (and when ranks share a GPU). `rank` only labels the log line.
Result<CudaLayerOptions> CudaOptionsFor(const DeviceFlags& f, DType dtype, int rank);

// An expert rank's grouped FFN on its GPU: one CUDA layer per loaded layer (its experts only).
Result<ExpertCompute> CudaExpertCompute(const DeviceFlags& f, int rank, const LoadedLayers& layers);

}  // namespace moerun
