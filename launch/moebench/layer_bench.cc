#include "launch/moebench/layer_bench.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "base/exit_code.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "launch/moebench/cuda_layer_bench.h"
#include "launch/moebench/floor.h"
#include "launch/moebench/memory_bandwidth.h"
#include "launch/moebench/sgemm_baseline.h"
#include "launch/moebench/timing.h"
#include "launch/plot/svg_plot.h"
#include "runtime/layer/moe_layer.h"
#include "runtime/layer/reference_layer.h"
#include "runtime/model/preset.h"

namespace moerun::bench {

std::vector<float> RandomInput(int64_t tokens, int64_t hidden, uint64_t seed) {
  std::vector<float> x(static_cast<size_t>(tokens * hidden));
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 12345;
  for (auto& v : x) {
    s += 0x9e3779b97f4a7c15ull;
    uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    // Uniform in [-sqrt(3), sqrt(3)): unit variance.
    v = (static_cast<float>(z >> 40) / 16777216.0f * 2.0f - 1.0f) * 1.7320508f;
  }
  return x;
}

namespace {

using json = nlohmann::json;

std::vector<GemmShape> LayerShapes(const MoeLayerWeights& w, int64_t t) {
  const ModelSpec& s = w.spec;
  std::vector<GemmShape> shapes = {{t, s.num_experts, s.hidden},
                                   {t * s.top_k, 2 * s.expert_inter, s.hidden},
                                   {t * s.top_k, s.hidden, s.expert_inter}};
  if (w.shared) {
    shapes.push_back({t, 2 * s.shared_inter, s.hidden});
    shapes.push_back({t, s.hidden, s.shared_inter});
  }
  return shapes;
}

// OpenBLAS sgemm on the layer's total GEMM shape at T tokens: the best of the core types (null
// if none ran).
json SgemmBaseline(const MoeLayerWeights& w, int64_t t, int threads, double min_seconds,
                   const std::vector<std::string>& coretypes) {
  json runs = json::array();
  json best;
  for (const auto& ct : coretypes) {
    auto res = RunSgemmBaseline(LayerShapes(w, t), threads, min_seconds, ct);
    if (!res.ok()) {
      spdlog::warn("sgemm baseline ({}): {}", ct.empty() ? "as installed" : ct,
                   res.status().message());
      continue;
    }
    runs.push_back(*res);
    if (best.is_null() || (*res)["gflops"].get<double>() > best["gflops"].get<double>()) {
      best = *res;
    }
  }
  if (best.is_null()) return json();
  return {{"what", "OpenBLAS sgemm of the same total shape (experts' rows as one dense GEMM)"},
          {"best", best},
          {"runs", runs}};
}

// One weight type of the run: its layer, built from the same flags but for the type.
struct TypedLayer {
  std::string flag;  // as given to --dtype
  std::shared_ptr<const MoeLayerWeights> w;
  std::unique_ptr<MoeLayer> layer;
};

// --dtype as a comma-separated list: each name parsed, none twice.
Result<std::vector<std::pair<std::string, DType>>> ParseDTypes(const std::string& list) {
  std::vector<std::pair<std::string, DType>> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    MOERUN_ASSIGN_OR_RETURN(DType t, ParseWeightDType(item));
    for (const auto& [name, seen] : out) {
      if (seen == t) return Status::InvalidArgument("--dtype names " + item + " twice");
    }
    out.emplace_back(item, t);
  }
  if (out.empty()) return Status::InvalidArgument("--dtype names no weight type");
  return out;
}

// The layers of every --dtype. With several types, a preset gets the same experts in each (the
// budget of the widest type unless --experts says), so that the types run the same layer.
Result<std::vector<TypedLayer>> LoadTypedLayers(const LayerFlags& flags, const CpuKernels& kernels,
                                                int threads) {
  MOERUN_ASSIGN_OR_RETURN(auto types, ParseDTypes(flags.dtype));
  LayerFlags lf = flags;
  if (types.size() > 1) {
    if (!flags.model.empty()) {
      return Status::InvalidArgument("--dtype with several types applies to presets, not --model");
    }
    if (lf.experts == 0 && !lf.preset.empty()) {
      int experts = 0;
      for (const auto& [name, t] : types) {
        PresetOptions o;
        o.dtype = t;
        o.intermediate = lf.intermediate;
        MOERUN_ASSIGN_OR_RETURN(ModelSpec s, PresetSpec(lf.preset, o, nullptr));
        experts = experts == 0 ? s.num_experts : std::min(experts, s.num_experts);
      }
      lf.experts = experts;
      spdlog::info("{}: {} experts for every --dtype (the budget of the widest type)", lf.preset,
                   experts);
    }
  }
  std::vector<TypedLayer> out;
  for (const auto& [name, t] : types) {
    lf.dtype = name;
    MOERUN_ASSIGN_OR_RETURN(auto w, LoadLayerFromFlags(lf, kernels, threads));
    out.push_back(TypedLayer{name, w, nullptr});
  }
  return out;
}

}  // namespace

// --plot: per weight type, the time per token (and the sgemm baseline's) and how far above its
// floor the layer runs, over the token counts (log scale).
std::string LayerSvg(const json& report, const std::string& isa) {
  plot::LineChart per_token{"Time per token", "tokens per batch (T)", "\u00b5s per token", {}};
  plot::LineChart floor{
      "Layer time \u00f7 its floor (1 = at the floor)", "tokens per batch (T)", "x_floor", {}};
  per_token.log_x = floor.log_x = true;
  plot::LineSeries sgemm{"OpenBLAS sgemm, same shape (f32)", {}, {}};
  std::map<std::string, size_t> at;  // weight type -> its series
  for (const json& r : report["results"]) {
    const std::string dt = r["weight_dtype"].get<std::string>();
    if (!at.count(dt)) {
      at[dt] = per_token.series.size();
      per_token.series.push_back({"moerun " + dt, {}, {}});
      floor.series.push_back({"moerun " + dt, {}, {}});
    }
    const double t = r["tokens"].get<double>();
    per_token.series[at[dt]].x.push_back(t);
    per_token.series[at[dt]].y.push_back(r["ms"].get<double>() * 1e3 / t);
    floor.series[at[dt]].x.push_back(t);
    floor.series[at[dt]].y.push_back(r["x_floor"].get<double>());
    if (r.contains("sgemm") && at[dt] == 0) {
      sgemm.x.push_back(t);
      sgemm.y.push_back(r["sgemm"]["best"]["ms"].get<double>() * 1e3 / t);
    }
  }
  if (!sgemm.x.empty()) per_token.series.push_back(sgemm);
  plot::LineFigure fig;
  fig.title = fmt::format("moebench layer ({} kernels): {}, {} experts, top-{}", isa,
                          report.at("model").get<std::string>(), report.at("experts").get<int>(),
                          report.at("top_k").get<int>());
  fig.charts = {per_token, floor};
  return plot::LineFigureSvg(fig);
}

int RunLayerBench(const LayerBenchFlags& f) {
  if (!f.plot.empty()) {
    if (f.device == "cuda") {
      return FailWith(Status::InvalidArgument("--plot: only with --device cpu for now"));
    }
    if (Status s = plot::CheckSvgPath("--plot", f.plot); !s.ok()) return FailWith(s);
  }
  if (f.device == "cuda") return RunCudaLayerBench(f);
  if (f.anchors) {
    return FailWith(Status::InvalidArgument(
        "--anchors needs --device cuda (the full-size shapes of ANCHORS.md do not fit the CPU "
        "layer's memory budget)"));
  }
  if (f.device != "cpu") return FailWith(Status::InvalidArgument("--device must be cpu or cuda"));
  for (int64_t t : f.tokens) {
    if (t <= 0 || t > (1 << 20)) {
      return FailWith(Status::InvalidArgument("--tokens must be in 1..1048576"));
    }
  }
  if (!std::isfinite(f.min_seconds) || f.min_seconds < 0 || f.min_seconds > 3600) {
    return FailWith(Status::InvalidArgument("--min-time must be in 0..3600 seconds"));
  }
  if (f.reference_tokens < 1)
    return FailWith(Status::InvalidArgument("--reference-tokens must be >= 1"));
  if (Status s = ValidateLayerFlags(f.layer); !s.ok()) return FailWith(s);
  auto isa = ChooseIsa(f.layer.isa);
  if (!isa.ok()) return FailWith(isa.status());
  const CpuKernels& kernels = KernelsFor(*isa);
  ThreadPool pool(f.layer.threads);
  auto loaded = LoadTypedLayers(f.layer, kernels, pool.size());
  if (!loaded.ok()) return FailWith(loaded.status());
  std::vector<TypedLayer>& typed = *loaded;
  for (auto& tl : typed) tl.layer = std::make_unique<MoeLayer>(tl.w, kernels, &pool);
  const bool several = typed.size() > 1;
  const MoeLayerWeights& w0 = *typed[0].w;
  const int64_t hidden = w0.spec.hidden;

  const auto& cpu = DetectCpu();
  json report;
  std::string names;
  json dtype_names = json::array();
  for (const auto& tl : typed) {
    names += std::string(names.empty() ? "" : ",") + DTypeName(tl.w->dtype);
    dtype_names.push_back(DTypeName(tl.w->dtype));
  }
  report["bench"] = "layer";
  report["layer"] = DescribeLayer(w0.spec, w0.layer, names);
  report["model"] = f.layer.model.empty() ? "preset:" + f.layer.preset : f.layer.model;
  report["family"] = FamilyName(w0.spec.family);
  report["experts"] = w0.spec.num_experts;
  report["top_k"] = w0.spec.top_k;
  report["hidden"] = hidden;
  report["expert_intermediate"] = w0.spec.expert_inter;
  report["weight_dtype"] = names;
  report["weight_dtypes"] = dtype_names;
  report["device"] = "cpu";
  report["cpu"] = cpu.brand;
  report["isa"] = IsaName(*isa);
  report["threads"] = pool.size();
  report["results"] = json::array();
  // The physical floor of a batch: the larger of reading its experts' weights once at the
  // measured read bandwidth, and its FLOPs at the best sgemm rate measured here.
  const ReadBandwidth read = MeasureReadBandwidth(&pool);
  const double read_bps = read.bytes_per_s;
  report["memory_read_gbps"] = read_bps / 1e9;
  json read_gbps;
  for (const ReadVariantRate& v : read.variants) read_gbps[IsaName(v.isa)] = v.bytes_per_s / 1e9;
  report["floor_read"] = {{"what", "best pass of each read kernel on every thread of the run"},
                          {"gbps", read_gbps},
                          {"used", IsaName(read.best)},
                          {"threads", read.threads},
                          {"buffer_bytes", read.buffer_bytes},
                          {"reps", read.reps},
                          {"sums_agree", read.sums_agree}};
  std::fprintf(stderr, "layer: floor read bandwidth %.1f GB/s (%s kernel, %d threads)\n",
               read_bps / 1e9, IsaName(read.best), read.threads);
  bool any_floor_fault = false;

  // The sgemm baseline of every T first (its shape is the same for every weight type). Its best
  // rate in the run is the compute floor's rate: at small T sgemm's rate is bound by reading its
  // own f32 matrices (and by call overheads), which is no floor, so a run without a T of at
  // least 1024 times sgemm at 1024 too, for the compute floor alone.
  std::map<int64_t, json> sgemm;
  double peak_gflops = 0;
  if (f.sgemm) {
    const std::vector<std::string> coretypes = CandidateCoreTypes();
    std::vector<int64_t> sgemm_tokens = f.tokens;
    constexpr int64_t kComputeBoundTokens = 1024;
    if (f.tokens.empty() ||
        *std::max_element(f.tokens.begin(), f.tokens.end()) < kComputeBoundTokens) {
      sgemm_tokens.push_back(kComputeBoundTokens);
    }
    for (int64_t t : sgemm_tokens) {
      sgemm[t] = SgemmBaseline(w0, t, pool.size(), f.min_seconds, coretypes);
      if (!sgemm[t].is_null()) {
        peak_gflops = std::max(peak_gflops, sgemm[t]["best"]["gflops"].get<double>());
      }
    }
  }
  for (int64_t t : f.tokens) {
    const std::vector<float> x = RandomInput(t, hidden, f.layer.seed + static_cast<uint64_t>(t));
    const json& sgemm_block = sgemm[t];
    const double sgemm_gflops =
        sgemm_block.is_null() ? 0 : sgemm_block["best"]["gflops"].get<double>();
    std::vector<json> rows;  // this T's results, one per weight type
    for (TypedLayer& tl : typed) {
      const MoeLayerWeights& w = *tl.w;
      MoeLayer& layer = *tl.layer;
      std::vector<float> out(static_cast<size_t>(t * hidden));
      Status st;
      const Timing ours =
          TimeIt([&] { st = layer.Forward(x.data(), t, out.data()); }, 3, f.min_seconds);
      if (!st.ok()) return FailWith(st);
      const double flops = layer.Flops(t);
      std::set<int32_t> active(layer.last_routing().ids.begin(), layer.last_routing().ids.end());
      size_t weight_bytes = w.shared ? w.shared->bytes() : 0;
      for (int32_t e : active) weight_bytes += w.experts[static_cast<size_t>(e)].bytes();

      json r;
      r["tokens"] = t;
      r["weight_dtype"] = DTypeName(w.dtype);
      r["ms"] = ours.median_ms;
      r["min_ms"] = ours.min_ms;
      r["reps"] = ours.reps;
      r["tokens_per_s"] = static_cast<double>(t) / (ours.median_ms / 1e3);
      r["gflops"] = flops / (ours.median_ms * 1e6);
      r["experts_active"] = active.size();
      r["weight_bytes"] = weight_bytes;
      r["weight_read_gbps"] = static_cast<double>(weight_bytes) / (ours.median_ms * 1e6);

      // The plain per-token reference on the first few tokens; its time scales linearly in T.
      const int64_t rt = std::min<int64_t>(t, std::max(1, f.reference_tokens));
      std::vector<float> ref(static_cast<size_t>(rt * hidden));
      const Timing rtime =
          TimeIt([&] { ReferenceForward(w, x.data(), rt, ref.data()); }, 1, 0.0, 1);
      double num = 0, den = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        const double d = static_cast<double>(out[i]) - ref[i];
        num += d * d;
        den += static_cast<double>(ref[i]) * ref[i];
      }
      const double ref_ms = rtime.median_ms / static_cast<double>(rt) * static_cast<double>(t);
      r["reference"] = {{"what", "per-token loop, double accumulation"},
                        {"tokens_timed", rt},
                        {"ms", ref_ms},
                        {"gflops", flops / (ref_ms * 1e6)}};
      r["speedup_vs_reference"] = ref_ms / ours.median_ms;
      r["check_rel_err_vs_reference"] = den > 0 ? std::sqrt(num / den) : std::sqrt(num);

      std::string sgemm_line;
      if (sgemm_gflops > 0) {
        r["sgemm"] = sgemm_block;
        r["fraction_of_sgemm"] = r["gflops"].get<double>() / sgemm_gflops;
        r["speedup_vs_sgemm"] = sgemm_block["best"]["ms"].get<double>() / ours.median_ms;
        sgemm_line = fmt::format(" | sgemm {} {:.1f} GFLOP/s -> fraction {:.2f}",
                                 sgemm_block["best"]["corename"].get<std::string>(), sgemm_gflops,
                                 r["fraction_of_sgemm"].get<double>());
      }
      const double read_floor_ms = static_cast<double>(weight_bytes) / read_bps * 1e3;
      const double compute_floor_ms = peak_gflops > 0 ? flops / (peak_gflops * 1e6) : 0;
      const double floor_ms = std::max(read_floor_ms, compute_floor_ms);
      r["floor"] = {{"what",
                     "max(active expert weights as held (FP8/MXFP4: codes and scales) / memory "
                     "read bandwidth, FLOPs / best sgemm rate at any T), both measured in this "
                     "run"},
                    {"read_ms", read_floor_ms},
                    {"compute_gflops", peak_gflops},
                    {"compute_ms", compute_floor_ms},
                    {"ms", floor_ms}};
      r["x_floor"] = ours.median_ms / floor_ms;
      // Below the floor is no success: the floor under-reads the machine (exit code stays 0).
      r["floor_fault"] = IsFloorFault(r["x_floor"].get<double>());
      if (r["floor_fault"].get<bool>()) {
        const bool memory_bound = read_floor_ms >= compute_floor_ms;
        r["floor_fault_reason"] = FloorFaultReason(
            r["x_floor"].get<double>(), memory_bound,
            memory_bound ? r["weight_read_gbps"].get<double>() : r["gflops"].get<double>(),
            memory_bound ? read_bps / 1e9 : peak_gflops);
        any_floor_fault = true;
      }
      const std::string what =
          several ? fmt::format("{} {}", IsaName(*isa), DTypeName(w.dtype)) : IsaName(*isa);
      std::fprintf(stderr,
                   "layer %s T=%lld: %.3f ms, %.0f tok/s, %.1f GFLOP/s, %.1f GB/s weights%s | "
                   "x_floor %.2f | reference x%.0f\n",
                   what.c_str(), static_cast<long long>(t), ours.median_ms,
                   r["tokens_per_s"].get<double>(), r["gflops"].get<double>(),
                   r["weight_read_gbps"].get<double>(), sgemm_line.c_str(),
                   r["x_floor"].get<double>(), r["speedup_vs_reference"].get<double>());
      if (r["floor_fault"].get<bool>()) {
        std::fprintf(stderr, "layer %s T=%lld: FLOOR FAULT: %s\n", what.c_str(),
                     static_cast<long long>(t), r["floor_fault_reason"].get<std::string>().c_str());
      }
      rows.push_back(std::move(r));
    }
    // Each type against F32 and BF16 of the same run and T (types narrower than the baseline).
    for (DType base : {DType::kF32, DType::kBF16}) {
      const json* b = nullptr;
      for (const json& r : rows) {
        if (r["weight_dtype"] == DTypeName(base)) b = &r;
      }
      if (b == nullptr) continue;
      const std::string key = std::string("speedup_vs_") + (base == DType::kF32 ? "f32" : "bf16");
      for (json& r : rows) {
        const std::string name = r["weight_dtype"].get<std::string>();
        if (name == "F32" || (base == DType::kBF16 && name == "BF16")) continue;
        r[key] = (*b)["ms"].get<double>() / r["ms"].get<double>();
        std::fprintf(stderr, "layer %s T=%lld: %s %.2f\n", name.c_str(), static_cast<long long>(t),
                     key.c_str(), r[key].get<double>());
      }
    }
    for (json& r : rows) report["results"].push_back(std::move(r));
  }
  report["floor_fault"] = any_floor_fault;
  if (f.json) {
    std::printf("%s\n", report.dump(2).c_str());
  }
  if (!f.plot.empty()) {
    if (Status s = plot::WriteSvg(f.plot, LayerSvg(report, IsaName(*isa))); !s.ok()) {
      return FailWith(s);
    }
    std::fprintf(stderr, "layer: plot written to %s\n", f.plot.c_str());
  }
  return 0;
}

}  // namespace moerun::bench
