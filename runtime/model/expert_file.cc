#include "runtime/model/expert_file.h"

#include <algorithm>
#include <filesystem>

#include "runtime/model/checkpoint.h"
#include "runtime/model/layer_loader.h"

namespace moerun {
namespace {

// A few of the file's tensor names, to show what it holds when an expected one is missing.
std::string SomeNames(const Checkpoint& ck) {
  const std::vector<std::string> names = ck.Names();
  if (names.empty()) return "the file holds no tensors";
  std::string out = "the file holds " + std::to_string(names.size()) + " tensor" +
                    (names.size() == 1 ? "" : "s") + ": ";
  const size_t shown = std::min<size_t>(names.size(), 4);
  for (size_t i = 0; i < shown; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  return out + (shown < names.size() ? ", ..." : "");
}

}  // namespace

Result<ExpertWeights> LoadExpertFile(const std::string& path, const ModelSpec& spec, int layer,
                                     int expert, DType held, const CpuKernels& kernels) {
  const std::string what =
      "expert " + std::to_string(expert) + " of layer " + std::to_string(layer) + " from " + path;
  auto fail = [&](const Status& st) { return Status(st.code(), what + ": " + st.message()); };
  if (Status st = spec.Validate(); !st.ok()) return fail(st);
  if (layer < 0) return fail(Status::InvalidArgument("a layer must be given (got -1)"));
  if (auto l = ResolveMoeLayer(spec, layer); !l.ok()) return fail(l.status());
  if (expert < 0 || expert >= spec.num_experts) {
    return fail(Status::InvalidArgument("expert " + std::to_string(expert) +
                                        " is out of range: the layer has " +
                                        std::to_string(spec.num_experts) + " experts (0.." +
                                        std::to_string(spec.num_experts - 1) + ")"));
  }
  if (!IsPackableType(held)) {
    return fail(Status::InvalidArgument(std::string("cannot hold expert weights as ") +
                                        DTypeName(held) + " (F32, BF16, F16, FP8, MXFP4 can be)"));
  }
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return fail(Status::NotFound("no such file"));
  }
  if (!std::filesystem::is_regular_file(path, ec)) {
    return fail(Status::InvalidArgument("not a file (a .safetensors file is expected)"));
  }
  auto ck = Checkpoint::Open(path);
  if (!ck.ok()) {
    return fail(
        Status(ck.status().code(), "not a valid .safetensors file: " + ck.status().message()));
  }
  LoadOptions opts;
  opts.layer = layer;
  opts.experts_only = true;
  opts.load_expert.assign(static_cast<size_t>(spec.num_experts), false);
  opts.load_expert[static_cast<size_t>(expert)] = true;
  opts.hold_as = held;
  // The file's quantized tensors follow the serving model's quantization_config.
  auto w = LoadLayer(**ck, spec, kernels, opts);
  if (!w.ok()) {
    Status st = fail(w.status());
    if (st.code() == StatusCode::kNotFound) {
      st = Status(st.code(), st.message() + " (" + SomeNames(**ck) + ")");
    }
    return st;
  }
  ExpertWeights e = std::move(w->experts[static_cast<size_t>(expert)]);
  if (e.w13.empty() || w->dtype != held || e.w13.dtype() != held || e.w2.dtype() != held) {
    return fail(Status::Internal(std::string("loaded expert is held as ") +
                                 DTypeName(e.w13.empty() ? w->dtype : e.w13.dtype()) +
                                 " but the serving layer holds " + DTypeName(held)));
  }
  return e;
}

}  // namespace moerun
