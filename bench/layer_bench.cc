#include "bench/layer_bench.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "base/exit_code.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "bench/cuda_layer_bench.h"
#include "bench/memory_bandwidth.h"
#include "bench/sgemm_baseline.h"
#include "bench/timing.h"
#include "layer/moe_layer.h"
#include "layer/reference_layer.h"

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

}  // namespace

int RunLayerBench(const LayerBenchFlags& f) {
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
  auto loaded = LoadLayerFromFlags(f.layer, kernels, pool.size());
  if (!loaded.ok()) return FailWith(loaded.status());
  const MoeLayerWeights& w = **loaded;
  MoeLayer layer(*loaded, kernels, &pool);
  const int64_t hidden = w.spec.hidden;

  const auto& cpu = DetectCpu();
  json report;
  report["bench"] = "layer";
  report["layer"] = DescribeLayer(w);
  report["model"] = f.layer.model.empty() ? "preset:" + f.layer.preset : f.layer.model;
  report["family"] = FamilyName(w.spec.family);
  report["experts"] = w.spec.num_experts;
  report["top_k"] = w.spec.top_k;
  report["hidden"] = hidden;
  report["expert_intermediate"] = w.spec.expert_inter;
  report["weight_dtype"] = DTypeName(w.dtype);
  report["device"] = "cpu";
  report["cpu"] = cpu.brand;
  report["isa"] = IsaName(*isa);
  report["threads"] = pool.size();
  report["results"] = json::array();
  // The physical floor of a batch: the larger of reading its experts' weights once at the
  // measured read bandwidth, and its FLOPs at the best sgemm rate measured here.
  const double read_bps = MeasureReadBandwidth(&pool);
  report["memory_read_gbps"] = read_bps / 1e9;

  std::vector<std::string> coretypes = CandidateCoreTypes();
  for (int64_t t : f.tokens) {
    const std::vector<float> x = RandomInput(t, hidden, f.layer.seed + static_cast<uint64_t>(t));
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
    const Timing rtime = TimeIt([&] { ReferenceForward(w, x.data(), rt, ref.data()); }, 1, 0.0, 1);
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

    double sgemm_gflops = 0;
    std::string sgemm_line;
    if (f.sgemm) {
      json runs = json::array();
      json best;
      for (const auto& ct : coretypes) {
        auto res = RunSgemmBaseline(LayerShapes(w, t), pool.size(), f.min_seconds, ct);
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
      if (!best.is_null()) {
        r["sgemm"] = {{"what",
                       "OpenBLAS sgemm of the same total shape (experts' rows as one "
                       "dense GEMM)"},
                      {"best", best},
                      {"runs", runs}};
        sgemm_gflops = best["gflops"].get<double>();
        r["fraction_of_sgemm"] = r["gflops"].get<double>() / sgemm_gflops;
        r["speedup_vs_sgemm"] = best["ms"].get<double>() / ours.median_ms;
        sgemm_line = fmt::format(" | sgemm {} {:.1f} GFLOP/s -> fraction {:.2f}",
                                 best["corename"].get<std::string>(), best["gflops"].get<double>(),
                                 r["fraction_of_sgemm"].get<double>());
      }
    }
    const double read_floor_ms = static_cast<double>(weight_bytes) / read_bps * 1e3;
    const double compute_floor_ms = sgemm_gflops > 0 ? flops / (sgemm_gflops * 1e6) : 0;
    const double floor_ms = std::max(read_floor_ms, compute_floor_ms);
    r["floor"] = {{"what",
                   "max(active expert weights / memory read bandwidth, FLOPs / best sgemm "
                   "rate), both measured in this run"},
                  {"read_ms", read_floor_ms},
                  {"compute_ms", compute_floor_ms},
                  {"ms", floor_ms}};
    r["x_floor"] = ours.median_ms / floor_ms;
    std::fprintf(stderr,
                 "layer %s T=%lld: %.3f ms, %.0f tok/s, %.1f GFLOP/s, %.1f GB/s weights%s | "
                 "x_floor %.2f | reference x%.0f\n",
                 IsaName(*isa), static_cast<long long>(t), ours.median_ms,
                 r["tokens_per_s"].get<double>(), r["gflops"].get<double>(),
                 r["weight_read_gbps"].get<double>(), sgemm_line.c_str(),
                 r["x_floor"].get<double>(), r["speedup_vs_reference"].get<double>());
    report["results"].push_back(r);
  }
  if (f.json) {
    std::printf("%s\n", report.dump(2).c_str());
  }
  return 0;
}

}  // namespace moerun::bench
