// Where a job's layer weights come from (a checkpoint folder, a preset, or any shape with seeded
// weights) and loading them: whole layers or only some experts, on several threads at start or
// on one thread in the background while serving, with progress in the log every 2 s and, in the
// background, a bandwidth limit, a byte count and a way to stop.
// Thread-safety: the functions are reentrant; a LoadThrottle's atomics may be read from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "experts/cpu/kernels.h"
#include "runtime/model/checkpoint.h"
#include "runtime/model/layer_weights.h"
#include "runtime/model/model_spec.h"

namespace moerun {

struct WeightSource {
  std::string model;              // checkpoint folder, or
  std::string preset;             // preset name, or
  std::optional<ModelSpec> spec;  // any shape, with seeded weights as presets make them
  uint64_t seed = 1;
  int experts = 0;
  int64_t intermediate = 0;  // presets: a scaled expert intermediate size (0: the model's)
  double gate_skew = 0.0;    // presets: Zipf exponent of the routing (runtime/model/preset.h)
  DType dtype = DType::kF32;
};

// What a background load may use: a bandwidth limit, where to report bytes done, when to stop.
struct LoadThrottle {
  double bytes_per_s = 0;  // 0: unlimited
  std::atomic<uint64_t>* bytes_done = nullptr;
  const std::atomic<bool>* cancel = nullptr;
};

// The model spec a source describes (experts scaled as the preset says); `note` gets what a
// preset changed, if anything.
Result<ModelSpec> SpecOf(const WeightSource& source, std::string* note = nullptr);

// Loads `layer` of `spec` from `source` for `kernels`: the router's tensors always, and the
// experts of `mask` (the others left empty). `what` names the load in its progress lines.
Result<std::shared_ptr<MoeLayerWeights>> LoadWeights(const WeightSource& source,
                                                     const ModelSpec& spec, int layer,
                                                     std::vector<bool> mask,
                                                     const CpuKernels& kernels, int threads,
                                                     const std::string& what,
                                                     const LoadThrottle& throttle = {});

// Loads one expert of a source at a time, as often as asked (an expert cache's misses): a
// checkpoint's files are opened once and stay mapped for the reader's life, so loads go on
// working when the checkpoint's folder is deleted or renamed under a running job. Experts are
// held as LoadWeights holds them. Thread-safe.
class ExpertReader {
 public:
  static Result<std::unique_ptr<ExpertReader>> Open(const WeightSource& source,
                                                    const ModelSpec& spec,
                                                    const CpuKernels& kernels);
  ~ExpertReader();
  Result<ExpertWeights> Load(int layer, int expert) const;

 private:
  ExpertReader() = default;
  WeightSource source_;
  ModelSpec spec_;
  const CpuKernels* kernels_ = nullptr;
  std::unique_ptr<Checkpoint> ckpt_;
};

}  // namespace moerun
