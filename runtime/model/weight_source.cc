#include "runtime/model/weight_source.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>

#include "base/log.h"
#include "base/resident_memory.h"
#include "runtime/model/checkpoint.h"
#include "runtime/model/layer_loader.h"
#include "runtime/model/preset.h"

namespace moerun {
namespace {

// Logs progress every 2 s; with a throttle, also reports the bytes done and sleeps so that the
// load stays under its bandwidth (the loads it throttles run on one thread).
std::function<void(int, int, size_t)> Progress(const std::string& what,
                                               const LoadThrottle& throttle = {}) {
  auto start = std::chrono::steady_clock::now();
  auto last = std::make_shared<std::chrono::steady_clock::time_point>(start);
  return [=](int done, int total, size_t bytes) {
    if (throttle.bytes_done != nullptr) throttle.bytes_done->store(bytes);
    if (throttle.bytes_per_s > 0) {
      const auto due =
          start +
          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
              std::chrono::duration<double>(static_cast<double>(bytes) / throttle.bytes_per_s));
      while (std::chrono::steady_clock::now() < due &&
             (throttle.cancel == nullptr || !throttle.cancel->load())) {
        std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
            due - std::chrono::steady_clock::now(), std::chrono::milliseconds(20)));
      }
    }
    const auto now = std::chrono::steady_clock::now();
    if (done != total && now - *last < std::chrono::seconds(2)) return;
    *last = now;
    spdlog::info("{}: {}/{} experts, {:.1f} MiB, {:.1f} s", what, done, total,
                 static_cast<double>(bytes) / (1 << 20),
                 std::chrono::duration<double>(now - start).count());
  };
}

}  // namespace

Result<std::shared_ptr<MoeLayerWeights>> LoadWeights(const WeightSource& src, const ModelSpec& spec,
                                                     int layer, std::vector<bool> mask,
                                                     const CpuKernels& kernels, int threads,
                                                     const std::string& what,
                                                     const LoadThrottle& throttle) {
  if (!src.model.empty()) {
    const Result<size_t> resident_before = ResidentBytes();
    std::shared_ptr<MoeLayerWeights> w;
    {
      MOERUN_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(src.model));
      LoadOptions o;
      o.layer = layer;
      o.load_expert = std::move(mask);
      o.threads = threads;
      o.progress = Progress(what, throttle);
      MOERUN_ASSIGN_OR_RETURN(MoeLayerWeights lw, LoadLayer(*ckpt, spec, kernels, o));
      w = std::make_shared<MoeLayerWeights>(std::move(lw));
    }  // the checkpoint's mapping goes here: its pages no longer count as ours
    // What the weights cost, as the process's resident memory before and after (tests read
    // this line); a failed read says so instead of numbers that would look like no growth.
    const Result<size_t> resident_after = ResidentBytes();
    if (resident_before.ok() && resident_after.ok()) {
      spdlog::info(
          "{}: experts held as {}, {:.1f} MiB; resident {:.1f} MiB before loading, {:.1f} "
          "MiB after",
          what, HeldTypeName(w->dtype), static_cast<double>(w->ExpertBytes()) / (1 << 20),
          static_cast<double>(*resident_before) / (1 << 20),
          static_cast<double>(*resident_after) / (1 << 20));
    } else {
      spdlog::warn(
          "{}: experts held as {}, {:.1f} MiB; resident memory unknown: {}", what,
          HeldTypeName(w->dtype), static_cast<double>(w->ExpertBytes()) / (1 << 20),
          (resident_before.ok() ? resident_after.status() : resident_before.status()).ToString());
    }
    return w;
  }
  PresetOptions o;
  o.seed = src.seed;
  o.gate_skew = src.gate_skew;
  o.dtype = src.dtype;
  o.layer = layer;
  o.load_expert = std::move(mask);
  o.threads = threads;
  o.progress = Progress(what, throttle);
  MOERUN_ASSIGN_OR_RETURN(MoeLayerWeights w, BuildPresetLayer(spec, kernels, o));
  return std::make_shared<MoeLayerWeights>(std::move(w));
}

Result<std::unique_ptr<ExpertReader>> ExpertReader::Open(const WeightSource& source,
                                                         const ModelSpec& spec,
                                                         const CpuKernels& kernels) {
  std::unique_ptr<ExpertReader> r(new ExpertReader());
  r->source_ = source;
  r->spec_ = spec;
  r->kernels_ = &kernels;
  if (!source.model.empty()) {
    MOERUN_ASSIGN_OR_RETURN(r->ckpt_, Checkpoint::Open(source.model));
    MOERUN_RETURN_IF_ERROR(r->ckpt_->OpenAllShards());
  }
  return r;
}

ExpertReader::~ExpertReader() = default;

Result<ExpertWeights> ExpertReader::Load(int layer, int expert) const {
  if (expert < 0 || expert >= spec_.num_experts) {
    return Status::InvalidArgument("no expert " + std::to_string(expert));
  }
  std::vector<bool> mask(static_cast<size_t>(spec_.num_experts), false);
  mask[static_cast<size_t>(expert)] = true;
  MoeLayerWeights w;
  if (ckpt_) {
    LoadOptions o;
    o.layer = layer;
    o.load_expert = std::move(mask);
    o.experts_only = true;
    MOERUN_ASSIGN_OR_RETURN(w, LoadLayer(*ckpt_, spec_, *kernels_, o));
  } else {
    PresetOptions o;
    o.seed = source_.seed;  // (the routing skew is the router's: experts do not depend on it)
    o.dtype = source_.dtype;
    o.layer = layer;
    o.load_expert = std::move(mask);
    o.experts_only = true;
    MOERUN_ASSIGN_OR_RETURN(w, BuildPresetLayer(spec_, *kernels_, o));
  }
  ExpertWeights out = std::move(w.experts[static_cast<size_t>(expert)]);
  if (out.w13.empty()) {
    return Status::Internal("expert " + std::to_string(expert) + " of layer " +
                            std::to_string(layer) + " did not load");
  }
  return out;
}

Result<ModelSpec> SpecOf(const WeightSource& source, std::string* note) {
  if (!source.model.empty()) return LoadModelSpec(source.model);
  if (source.spec) return *source.spec;
  PresetOptions o;
  o.seed = source.seed;
  o.experts = source.experts;
  o.intermediate = source.intermediate;
  o.dtype = source.dtype;
  return PresetSpec(source.preset, o, note);
}

}  // namespace moerun
