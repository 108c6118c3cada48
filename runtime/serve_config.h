// The YAML config of `moerun serve`, read strictly: unknown keys, wrong types and out-of-range
// values are errors that name the key. Relative paths (model, placement) are relative to the
// config file's folder. The README documents every key.
#pragma once

#include <string>
#include <vector>

#include "runtime/batcher.h"
#include "runtime/status.h"

namespace moerun {

struct ServeConfig {
  // Weights: a checkpoint folder, or a preset.
  std::string model;
  std::string preset;
  uint64_t seed = 1;
  int experts = 0;
  std::string dtype = "f32";
  // Layers to serve: empty = the model's first MoE layer; {-1} = every MoE layer.
  std::vector<int> layers;
  // The job.
  std::string transport;  // mpi | inproc | "" (mpi under an MPI launcher, else inproc)
  int ranks = 1;          // inproc only
  int routers = 1;
  std::string placement = "linear";
  int64_t microbatch_tokens = 0;
  int64_t deadline_ms = 30000;
  int64_t startup_timeout_s = 600;
  int threads = 0;
  std::string isa;
  BatcherOptions batching;
  std::string log_level = "info";
};

Result<ServeConfig> ParseServeConfig(const std::string& yaml_text, const std::string& source,
                                     const std::string& base_dir);
Result<ServeConfig> LoadServeConfig(const std::string& path);

}  // namespace moerun
