#include "launch/moebench/cuda_layer_bench.h"

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "base/exit_code.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "launch/layer_flags.h"
#include "launch/local_device.h"
#include "launch/moebench/floor.h"
#include "runtime/layer/cuda/cuda_device.h"
#include "runtime/layer/cuda/cuda_layer.h"
#include "runtime/layer/cuda/device_weights.h"
#include "runtime/model/layer_loader.h"
#include "runtime/model/preset.h"

namespace moerun::bench {
namespace {

using json = nlohmann::json;

// ANCHORS.md's H200 table: presets at their full expert count, bf16, these token counts.
const char* const kAnchorPresets[] = {"mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"};
const std::vector<int64_t> kAnchorTokens = {1, 16, 128, 1024, 8192};

// One layer to time: built on the device from a preset, or uploaded from --model.
struct DeviceLayer {
  std::unique_ptr<CudaMoeLayer> layer;
  std::string model;        // "preset:NAME" or the folder
  std::string description;  // "qwen3_moe layer 0: 128 experts top-8, hidden 2048, BF16 weights"
  DType weight_dtype = DType::kBF16;
};

Result<CudaMath> ParseMath(const std::string& name) {
  if (name == "tensor-core") return CudaMath::kTensorCore;
  if (name == "exact") return CudaMath::kExact;
  return Status::InvalidArgument("--math must be tensor-core or exact, not '" + name + "'");
}

Result<DeviceLayer> BuildLayer(const LayerFlags& lf, const CudaLayerOptions& opts) {
  DeviceLayer d;
  if (!lf.model.empty()) {
    MOERUN_ASSIGN_OR_RETURN(const Isa isa, ChooseIsa(lf.isa));
    ThreadPool pool(lf.threads);
    MOERUN_ASSIGN_OR_RETURN(auto w, LoadLayerFromFlags(lf, KernelsFor(isa), pool.size()));
    MOERUN_ASSIGN_OR_RETURN(d.layer, CudaMoeLayer::Upload(*w, opts));
    d.model = lf.model;
    d.description = DescribeLayer(*w);
    d.weight_dtype = w->dtype;
    return d;
  }
  if (lf.preset.empty()) {
    return Status::InvalidArgument("give exactly one of --model DIR and --preset NAME");
  }
  // The whole expert count (the CPU's 4 GB budget does not apply on the device) unless
  // --experts says otherwise.
  MOERUN_ASSIGN_OR_RETURN(const ModelSpec full, PresetFullSpec(lf.preset));
  PresetOptions preset;
  preset.seed = lf.seed;
  preset.experts = lf.experts > 0 ? lf.experts : full.num_experts;
  preset.intermediate = lf.intermediate;
  preset.layer = lf.layer;
  preset.budget_bytes = std::numeric_limits<size_t>::max();
  MOERUN_ASSIGN_OR_RETURN(preset.dtype, ParseWeightDType(lf.dtype));
  std::string note;
  MOERUN_ASSIGN_OR_RETURN(const ModelSpec spec, PresetSpec(lf.preset, preset, &note));
  if (!note.empty()) spdlog::info("{}", note);
  MOERUN_ASSIGN_OR_RETURN(const int layer, ResolveMoeLayer(spec, lf.layer));
  if (IsBlockScaled(
          preset.dtype)) {  // quantized on the host (runtime/model/preset.cc), then uploaded
    preset.threads = lf.threads > 0
                         ? lf.threads
                         : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    spdlog::info("building {} on the host ({} threads), then uploading it quantized: {}", lf.preset,
                 preset.threads, DescribeLayer(spec, layer, preset.dtype));
  } else {
    spdlog::info("generating {} on the device: {}", lf.preset,
                 DescribeLayer(spec, layer, preset.dtype));
  }
  MOERUN_ASSIGN_OR_RETURN(d.layer, CudaMoeLayer::FromPreset(spec, preset, opts));
  d.model = "preset:" + lf.preset;
  d.description = DescribeLayer(spec, layer, preset.dtype);
  d.weight_dtype = preset.dtype;
  return d;
}

// Repetitions so that one timing lasts about `min_seconds`: a short pilot, then the real one.
Result<CudaTimes> TimeLayer(CudaMoeLayer& layer, const float* x, int64_t tokens, double min_seconds,
                            int max_reps) {
  MOERUN_ASSIGN_OR_RETURN(const CudaTimes pilot, layer.Time(x, tokens, 2, 3));
  const double est_ms = std::max(pilot.median_ms, 1e-3);
  const double want = std::ceil(min_seconds * 1e3 / est_ms);
  const int reps = static_cast<int>(std::clamp(want, 3.0, static_cast<double>(max_reps)));
  return layer.Time(x, tokens, 3, reps);
}

std::string ShellQuote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') {
      q += "'\\''";
    } else {
      q += c;
    }
  }
  return q + "'";
}

std::string JoinTokens(const std::vector<int64_t>& tokens) {
  std::string s;
  for (int64_t t : tokens) {
    if (!s.empty()) s += ',';
    s += std::to_string(t);
  }
  return s;
}

// The torch grouped baseline of one shape: {"ok": true, "ms": {"T": ms}, ...} from the helper,
// or {"ok": false, "error": why}.
json RunTorchGrouped(const LayerBenchFlags& f, const ModelSpec& s,
                     const std::vector<int64_t>& tokens, int device, const char* dtype) {
  const std::string script = FindTorchScript(f.torch_script);
  if (script.empty()) {
    return {{"ok", false},
            {"error", "bench/torch_grouped.py not found beside this binary; give --torch-script"}};
  }
  std::string cmd;
  if (std::filesystem::exists("/usr/bin/timeout")) {
    const double limit = 120 + 3.0 * static_cast<double>(tokens.size()) * f.min_seconds;
    cmd = "/usr/bin/timeout " + std::to_string(static_cast<int>(limit)) + " ";
  }
  cmd += ShellQuote(f.torch_python) + " " + ShellQuote(script) +
         fmt::format(" --hidden {} --inter {} --experts {} --top-k {} --shared-inter {}", s.hidden,
                     s.expert_inter, s.num_experts, s.top_k, s.shared_inter) +
         " --tokens " + JoinTokens(tokens) + " --dtype " + dtype +
         fmt::format(" --min-time {} --max-reps {} --device-index {} --check", f.min_seconds,
                     f.max_reps, device);
  spdlog::info("torch grouped baseline: {}", cmd);
  std::fflush(stdout);
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {{"ok", false}, {"error", "could not start " + f.torch_python}};
  std::string out;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  const int rc = status == -1 ? -1 : (WIFEXITED(status) ? WEXITSTATUS(status) : 128);
  // The helper prints one JSON object as its last line; anything before it is ignored.
  json parsed;
  const size_t end = out.find_last_not_of(" \t\r\n");
  if (end != std::string::npos) {
    const size_t newline = out.rfind('\n', end);
    const size_t from = newline == std::string::npos ? 0 : newline + 1;
    parsed = json::parse(out.substr(from, end + 1 - from), nullptr, /*allow_exceptions=*/false);
  }
  if (!parsed.is_object()) {
    std::string why = rc == 127   ? f.torch_python + " not found"
                      : rc == 124 ? "the helper timed out"
                                  : "the helper exited with " + std::to_string(rc) +
                                        " and printed no JSON object";
    return {{"ok", false}, {"error", why}};
  }
  if (!parsed.value("ok", false)) {
    if (!parsed.contains("error") || !parsed["error"].is_string()) {
      parsed["error"] = "the helper exited with " + std::to_string(rc);
    }
    parsed["ok"] = false;
  }
  return parsed;
}

// The torch helper's time for `tokens` tokens, or NaN.
double TorchMs(const json& torch, int64_t tokens) {
  if (!torch.value("ok", false) || !torch.contains("ms")) return std::nan("");
  const json& ms = torch["ms"];
  const std::string key = std::to_string(tokens);
  if (!ms.is_object() || !ms.contains(key) || !ms[key].is_number()) return std::nan("");
  return ms[key].get<double>();
}

struct Shape {
  LayerFlags layer;
  std::vector<int64_t> tokens;
};

// One shape: our layer at every token count, then (after freeing it) the torch baseline.
Result<json> RunShape(const LayerBenchFlags& f, const Shape& shape, const CudaLayerOptions& opts,
                      bool want_torch) {
  MOERUN_ASSIGN_OR_RETURN(DeviceLayer d, BuildLayer(shape.layer, opts));
  const ModelSpec spec = d.layer->spec();
  const int64_t hidden = spec.hidden;
  FloorRates rates;
  rates.bytes_per_s = f.floor_gbps * 1e9;
  rates.flops_per_s = f.floor_tflops * 1e12;

  json report;
  report["bench"] = "layer";
  report["device"] = "cuda";
  report["gpu"] = d.layer->Describe();
  report["device_index"] = opts.device;
  report["math"] = CudaMathName(opts.math);
  report["layer"] = d.description;
  report["model"] = d.model;
  report["family"] = FamilyName(spec.family);
  report["experts"] = spec.num_experts;
  report["top_k"] = spec.top_k;
  report["hidden"] = hidden;
  report["expert_intermediate"] = spec.expert_inter;
  report["shared_intermediate"] = spec.shared_inter;
  report["weight_dtype"] = DTypeName(d.weight_dtype);
  report["device_weight_bytes"] = d.layer->weight_bytes();
  // Weights as the device holds them (runtime/layer/cuda/device_weights.h): tensor cores read
  // 16-bit values, block-scaled types stay codes and scales (FP8 ~1 byte a weight, MXFP4 ~0.53).
  MOERUN_ASSIGN_OR_RETURN(const cuda_plan::WeightFormat format,
                          cuda_plan::ChooseWeightFormat(
                              d.weight_dtype, opts.math == CudaMath::kTensorCore, opts.mma_type));
  const double weight_elt =
      cuda_plan::DeviceBytesPerWeight(format, hidden, std::max<int64_t>(spec.expert_inter, 1));
  report["device_weight_format"] = cuda_plan::WeightFormatName(format);
  report["device_bytes_per_weight"] = weight_elt;
  report["floor_rates"] = {
      {"what",
       "floor = max(bytes of the weights the batch's routing needs (distinct active experts, "
       "shared expert, fp32 gate) / copy bandwidth, FLOPs / dense matmul rate)"},
      {"gbps", f.floor_gbps},
      {"tflops", f.floor_tflops}};
  report["results"] = json::array();

  for (int64_t t : shape.tokens) {
    const std::vector<float> x =
        RandomInput(t, hidden, shape.layer.seed + static_cast<uint64_t>(t));
    MOERUN_ASSIGN_OR_RETURN(const CudaTimes times,
                            TimeLayer(*d.layer, x.data(), t, f.min_seconds, f.max_reps));
    // One more forward for the routing (and a look at the output).
    std::vector<float> out(x.size());
    MOERUN_RETURN_IF_ERROR(d.layer->Forward(x.data(), t, out.data()));
    std::vector<int32_t> ids;
    std::vector<float> weights;
    MOERUN_RETURN_IF_ERROR(d.layer->LastRouting(&ids, &weights));
    const bool finite =
        std::all_of(out.begin(), out.end(), [](float v) { return std::isfinite(v); });
    if (!finite) spdlog::warn("T={}: the layer's output holds non-finite values", t);

    FloorInput in;
    in.tokens = t;
    in.hidden = hidden;
    in.expert_inter = spec.expert_inter;
    in.num_experts = spec.num_experts;
    in.top_k = spec.top_k;
    in.shared_inter = spec.shared_inter;
    in.active_experts = CountActiveExperts(ids);
    in.weight_bytes_per_element = weight_elt;
    in.gate_bytes_per_element = 4;
    const Floor fl = ComputeFloor(in, rates);
    const double ms = times.median_ms;

    json r;
    r["tokens"] = t;
    r["ms"] = ms;
    r["min_ms"] = times.min_ms;
    r["reps"] = times.ms.size();
    r["tokens_per_s"] = static_cast<double>(t) / (ms / 1e3);
    r["tflops"] = fl.flops / (ms * 1e9);
    r["experts_active"] = in.active_experts;
    r["weight_bytes"] = fl.bytes;
    r["weight_read_gbps"] = fl.bytes / (ms * 1e6);
    r["floor_ms"] = fl.ms;
    r["floor"] = {{"memory_ms", fl.memory_ms},
                  {"compute_ms", fl.compute_ms},
                  {"bytes", fl.bytes},
                  {"flops", fl.flops},
                  {"bound", fl.memory_bound() ? "memory" : "compute"}};
    r["x_floor"] = fl.ms > 0 ? json(ms / fl.ms) : json(nullptr);
    r["output_finite"] = finite;
    r["torch_grouped_ms"] = nullptr;
    r["speedup_vs_torch_grouped"] = nullptr;
    report["results"].push_back(r);
  }
  report["graphs_captured"] = d.layer->graphs_captured();
  d.layer.reset();  // free the device memory before the baseline allocates its own

  json torch;
  if (!want_torch) {
    torch = {{"ok", false}, {"error", "--no-torch"}};
  } else {
    const char* dtype =
        opts.math == CudaMath::kTensorCore && opts.mma_type == DType::kF16 ? "f16" : "bf16";
    torch = RunTorchGrouped(f, spec, shape.tokens, opts.device, dtype);
    if (!torch.value("ok", false)) {
      const std::string why = torch.value("error", std::string("unknown"));
      if (f.torch == 1) {
        spdlog::warn("torch grouped baseline unavailable: {}", why);
      } else {
        spdlog::info("torch grouped baseline unavailable: {}", why);
      }
    }
  }
  if (torch.value("ok", false)) {
    json info = torch;
    info.erase("ok");
    info.erase("ms");
    report["torch"] = info;
  } else {
    report["torch"] = nullptr;
    report["torch_reason"] = torch.value("error", std::string("unknown"));
  }
  for (json& r : report["results"]) {
    const int64_t t = r["tokens"].get<int64_t>();
    const double ms = r["ms"].get<double>();
    const double tm = TorchMs(torch, t);
    std::string torch_part = "torch grouped n/a";
    if (std::isfinite(tm) && tm > 0) {
      r["torch_grouped_ms"] = tm;
      r["speedup_vs_torch_grouped"] = tm / ms;
      torch_part = fmt::format("torch grouped {:.3f} ms -> speedup {:.2f}", tm, tm / ms);
    }
    const json& fl = r["floor"];
    std::fprintf(stderr,
                 "layer cuda %s T=%lld: %.3f ms, %.0f tok/s, %.1f TFLOP/s, %lld experts | floor "
                 "%.3f ms (%s) -> x_floor %.2f | %s\n",
                 d.model.c_str(), static_cast<long long>(t), ms, r["tokens_per_s"].get<double>(),
                 r["tflops"].get<double>(),
                 static_cast<long long>(r["experts_active"].get<int64_t>()),
                 r["floor_ms"].get<double>(), fl["bound"].get<std::string>().c_str(),
                 r["x_floor"].is_number() ? r["x_floor"].get<double>() : 0.0, torch_part.c_str());
  }
  return report;
}

Status CheckFlags(const LayerBenchFlags& f) {
  for (int64_t t : f.tokens) {
    if (t <= 0 || t > (1 << 20)) return Status::InvalidArgument("--tokens must be in 1..1048576");
  }
  if (!std::isfinite(f.min_seconds) || f.min_seconds < 0 || f.min_seconds > 3600) {
    return Status::InvalidArgument("--min-time must be in 0..3600 seconds");
  }
  if (!std::isfinite(f.floor_gbps) || f.floor_gbps <= 0) {
    return Status::InvalidArgument("--floor-gbps must be a positive number");
  }
  if (!std::isfinite(f.floor_tflops) || f.floor_tflops <= 0) {
    return Status::InvalidArgument("--floor-tflops must be a positive number");
  }
  if (f.max_reps < 3) return Status::InvalidArgument("at least 3 repetitions per timing");
  if (f.anchors && (!f.layer.model.empty() || !f.layer.preset.empty())) {
    return Status::InvalidArgument("--anchors chooses its own presets: leave out --model/--preset");
  }
  if (!f.anchors && f.layer.model.empty() == f.layer.preset.empty()) {
    return Status::InvalidArgument("give exactly one of --model DIR, --preset NAME, --anchors");
  }
  MOERUN_RETURN_IF_ERROR(ParseMath(f.math).status());
  return ValidateLayerFlags(f.layer);
}

}  // namespace

std::string FindTorchScript(const std::string& flag) {
  if (!flag.empty()) return flag;
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  const fs::path script = exe.parent_path() / ".." / ".." / "bench" / "torch_grouped.py";
  if (!fs::exists(script, ec)) return "";
  return fs::weakly_canonical(script, ec).string();
}

int RunCudaLayerBench(const LayerBenchFlags& f) {
  if (Status s = CheckFlags(f); !s.ok()) return FailWith(s);
  auto required = RequireCuda();
  if (!required.ok()) return FailWith(required.status());
  const CudaProbe& probe = *required;
  const LocalDeviceChoice choice = ChooseLocalDevice(
      ProcessEnvironment(), static_cast<int>(probe.devices.size()), f.device_index);
  if (!choice.ok()) return FailWith(choice.error);
  CudaLayerOptions opts;
  opts.device = choice.device;
  opts.math = *ParseMath(f.math);

  std::vector<Shape> shapes;
  if (f.anchors) {
    const std::vector<std::string> names = PresetNames();
    for (const char* name : kAnchorPresets) {
      if (std::find(names.begin(), names.end(), name) == names.end()) {
        return FailWith(Status::Internal(std::string("anchor preset ") + name + " is missing"));
      }
      Shape s;
      s.layer = f.layer;
      s.layer.preset = name;
      s.layer.dtype = "bf16";
      s.tokens = f.tokens_given ? f.tokens : kAnchorTokens;
      shapes.push_back(s);
    }
  } else {
    // --dtype f32,bf16,fp8: one shape per type, on the same experts, in one run.
    std::string list = f.layer.dtype;
    for (size_t from = 0; from <= list.size();) {
      const size_t comma = std::min(list.find(',', from), list.size());
      Shape s{f.layer, f.tokens};
      s.layer.dtype = list.substr(from, comma - from);
      if (s.layer.dtype.empty()) {
        return FailWith(Status::InvalidArgument("--dtype: an empty entry in '" + list + "'"));
      }
      shapes.push_back(s);
      from = comma + 1;
    }
  }
  // The device arena holds the largest batch.
  opts.max_tokens = 1;
  for (const Shape& s : shapes) {
    for (int64_t t : s.tokens) opts.max_tokens = std::max(opts.max_tokens, t);
  }
  const bool want_torch = f.torch != 0;
  const CudaDeviceInfo& dev = probe.devices[static_cast<size_t>(opts.device)];
  spdlog::info("{}: {} (sm_{}{}), {} math", choice.Describe(), dev.name, dev.sm_major, dev.sm_minor,
               CudaMathName(opts.math));

  json reports = json::array();
  for (const Shape& s : shapes) {
    CudaLayerOptions o = opts;  // f16 weights run on f16 tensor cores, the rest on bf16
    o.mma_type = s.layer.dtype == "f16" || s.layer.dtype == "F16" ? DType::kF16 : DType::kBF16;
    auto r = RunShape(f, s, o, want_torch);
    if (!r.ok()) return FailWith(r.status());
    reports.push_back(std::move(r).value());
  }
  if (f.json) {
    json out;
    if (f.anchors || reports.size() > 1) {
      out["bench"] = "layer";
      out["device"] = "cuda";
      out["anchors"] = f.anchors;
      out["shapes"] = reports;
    } else {
      out = reports.front();
    }
    std::printf("%s\n", out.dump(2).c_str());
  }
  return 0;
}

}  // namespace moerun::bench
