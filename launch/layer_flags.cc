#include "launch/layer_flags.h"

#include <chrono>
#include <cmath>

#include "base/log.h"
#include "runtime/model/checkpoint.h"
#include "runtime/model/layer_loader.h"
#include "runtime/model/preset.h"

namespace moerun {
namespace {

// Logs loading progress at most about once a second (and at the end).
std::function<void(int, int, size_t)> ProgressLogger(const std::string& what) {
  auto start = std::chrono::steady_clock::now();
  auto last = std::make_shared<std::chrono::steady_clock::time_point>(start);
  return [=](int done, int total, size_t bytes) {
    const auto now = std::chrono::steady_clock::now();
    if (done != total && now - *last < std::chrono::seconds(1)) return;
    *last = now;
    const double s = std::chrono::duration<double>(now - start).count();
    spdlog::info("{}: {}/{} experts, {:.1f} MiB packed, {:.1f} s", what, done, total,
                 static_cast<double>(bytes) / (1 << 20), s);
  };
}

}  // namespace

Status ValidateLayerFlags(const LayerFlags& f) {
  if (f.threads < 0 || f.threads > 1024) {
    return Status::InvalidArgument("--threads must be in 0..1024 (0: one per core)");
  }
  if (f.layer < -1) return Status::InvalidArgument("--layer must not be negative");
  if (f.experts < 0) return Status::InvalidArgument("--experts must not be negative");
  if (f.intermediate < 0 || f.intermediate > (int64_t{1} << 22)) {
    return Status::InvalidArgument("--intermediate must be in 0..4194304 (0: the model's)");
  }
  if (f.intermediate > 0 && !f.model.empty()) {
    return Status::InvalidArgument("--intermediate scales a preset, not a --model checkpoint");
  }
  if (!std::isfinite(f.gate_skew) || f.gate_skew < 0 || f.gate_skew > 8) {
    return Status::InvalidArgument("--gate-skew must be in 0..8 (a Zipf exponent over experts)");
  }
  if (f.gate_skew > 0 && !f.model.empty()) {
    return Status::InvalidArgument("--gate-skew applies to presets, not to --model checkpoints");
  }
  if (!f.isa.empty() && !ParseIsa(f.isa)) {
    return Status::InvalidArgument("--isa must be scalar, avx2 or avx512, not '" + f.isa + "'");
  }
  return Status::Ok();
}

Result<Isa> ChooseIsa(const std::string& flag) {
  if (flag.empty()) {
    std::string warning;
    const Isa isa = DefaultIsa(&warning);
    if (!warning.empty()) spdlog::warn("{}", warning);
    return isa;
  }
  const auto isa = ParseIsa(flag);
  if (!isa)
    return Status::InvalidArgument("--isa must be scalar, avx2 or avx512, not '" + flag + "'");
  if (*isa > BestIsa()) {
    return Status::InvalidArgument(std::string("--isa ") + flag + ": this CPU supports up to " +
                                   IsaName(BestIsa()));
  }
  return *isa;
}

Result<DType> ParseWeightDType(const std::string& name) {
  if (name == "f32" || name == "F32") return DType::kF32;
  if (name == "bf16" || name == "BF16") return DType::kBF16;
  if (name == "f16" || name == "F16") return DType::kF16;
  if (name == "fp8" || name == "FP8" || name == "F8_E4M3") return DType::kF8E4M3;
  if (name == "mxfp4" || name == "MXFP4") return DType::kF4;
  return Status::InvalidArgument("--dtype must be f32, bf16, f16, fp8 or mxfp4, not '" + name +
                                 "'");
}

namespace {

PresetOptions PresetOptionsFor(const LayerFlags& f, DType dtype, int threads) {
  return PresetOptions{.seed = f.seed,
                       .experts = f.experts,
                       .intermediate = f.intermediate,
                       .dtype = dtype,
                       .layer = f.layer,
                       .gate_skew = f.gate_skew,
                       .threads = threads};
}

}  // namespace

Result<ModelSpec> SpecFromFlags(const LayerFlags& f) {
  if (f.model.empty() == f.preset.empty()) {
    return Status::InvalidArgument("give exactly one of --model DIR and --preset NAME");
  }
  if (!f.model.empty()) return LoadModelSpec(f.model);
  MOERUN_ASSIGN_OR_RETURN(const DType dtype, ParseWeightDType(f.dtype));
  std::string note;
  MOERUN_ASSIGN_OR_RETURN(ModelSpec spec,
                          PresetSpec(f.preset, PresetOptionsFor(f, dtype, 1), &note));
  if (!note.empty()) spdlog::info("{}", note);
  return spec;
}

Result<std::shared_ptr<const MoeLayerWeights>> LoadLayerFromFlags(const LayerFlags& f,
                                                                  const CpuKernels& kernels,
                                                                  int threads) {
  MOERUN_ASSIGN_OR_RETURN(ModelSpec spec, SpecFromFlags(f));
  if (!f.model.empty()) {
    MOERUN_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(f.model));
    LoadOptions opts;
    opts.layer = f.layer;
    opts.threads = threads;
    opts.progress = ProgressLogger("loading " + f.model);
    MOERUN_ASSIGN_OR_RETURN(MoeLayerWeights w, LoadLayer(*ckpt, spec, kernels, opts));
    return std::make_shared<const MoeLayerWeights>(std::move(w));
  }
  MOERUN_ASSIGN_OR_RETURN(const DType dtype, ParseWeightDType(f.dtype));
  PresetOptions opts = PresetOptionsFor(f, dtype, threads);
  if (f.layer >= 0) MOERUN_RETURN_IF_ERROR(ResolveMoeLayer(spec, f.layer).status());
  opts.progress = ProgressLogger("generating " + f.preset);
  MOERUN_ASSIGN_OR_RETURN(MoeLayerWeights w, BuildPresetLayer(spec, kernels, opts));
  return std::make_shared<const MoeLayerWeights>(std::move(w));
}

std::string DescribeLayer(const ModelSpec& s, int layer, const std::string& weights) {
  return std::string(FamilyName(s.family)) + " layer " + std::to_string(layer) + ": " +
         std::to_string(s.num_experts) + " experts top-" + std::to_string(s.top_k) + ", hidden " +
         std::to_string(s.hidden) + ", " + weights + " weights";
}

std::string DescribeLayer(const ModelSpec& s, int layer, DType dtype) {
  const char* name = dtype == DType::kF8E4M3 ? "FP8"
                     : dtype == DType::kF4   ? "MXFP4"
                                             : DTypeName(dtype);
  return DescribeLayer(s, layer, std::string(name));
}

std::string DescribeLayer(const MoeLayerWeights& w) {
  return DescribeLayer(w.spec, w.layer, w.dtype);
}

}  // namespace moerun
