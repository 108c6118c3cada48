#include "launch/moebench/model_cmd.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/exit_code.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "experts/cpu/isa.h"
#include "launch/layer_flags.h"
#include "launch/moebench/layer_bench.h"
#include "launch/moebench/perf_model.h"
#include "router/gating.h"
#include "router/placement.h"
#include "runtime/model/preset.h"
#include "runtime/model/weight_source.h"

namespace moerun::bench {
namespace {

using json = nlohmann::json;

Status Invalid(const std::string& m) { return Status::InvalidArgument(m); }

// Bytes one expert weight takes as held: FP8 with one F32 scale per 128 x 128 block, MXFP4 with
// one byte of scale per 32 values.
double WeightBytes(DType t) {
  switch (t) {
    case DType::kF8E4M3:
      return 1.0 + 4.0 / (128.0 * 128.0);
    case DType::kF4:
      return 0.5 + 1.0 / 32.0;
    case DType::kBF16:
    case DType::kF16:
      return 2.0;
    default:
      return 4.0;
  }
}

// The model's spec (a preset's full size unless --experts), with the shape overrides.
Result<ModelSpec> SpecFor(const ModelFlags& f, DType dtype) {
  ModelSpec s;
  if (!f.preset.empty()) {
    PresetOptions o;
    o.experts = f.experts;
    o.dtype = dtype;
    Result<ModelSpec> r =
        f.experts > 0 ? PresetSpec(f.preset, o, nullptr) : PresetFullSpec(f.preset);
    if (!r.ok()) return Invalid(r.status().message());
    s = *r;
  } else if (!f.model.empty()) {
    MOERUN_ASSIGN_OR_RETURN(s, LoadModelSpec(f.model));
    if (f.experts > 0) return Invalid("--experts applies to presets, not --model");
  } else {
    return Invalid("give --preset NAME or --model DIR");
  }
  if (f.hidden > 0) s.hidden = f.hidden;
  if (f.inter > 0) s.expert_inter = f.inter;
  if (f.shared_inter >= 0) s.shared_inter = f.shared_inter;
  if (f.top_k > 0) {
    if (f.top_k > s.num_experts) return Invalid("--top-k is more than the experts");
    s.top_k = f.top_k;
  }
  return s;
}

// Numbers separated by spaces, commas or new lines.
Result<std::vector<double>> ReadLoads(const std::string& path, int experts) {
  std::ifstream in(path);
  if (!in) return Invalid("--loads " + path + ": cannot read");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  std::replace(text.begin(), text.end(), ',', ' ');
  std::stringstream words(text);
  std::vector<double> v;
  std::string w;
  double sum = 0;
  while (words >> w) {
    try {
      size_t used = 0;
      const double x = std::stod(w, &used);
      if (used != w.size() || !std::isfinite(x) || x < 0) throw std::invalid_argument(w);
      v.push_back(x);
      sum += x;
    } catch (const std::exception&) {
      return Invalid("--loads " + path + ": '" + w + "' is not a load (a number >= 0)");
    }
  }
  if (static_cast<int>(v.size()) != experts) {
    return Invalid("--loads " + path + ": " + std::to_string(v.size()) + " loads for " +
                   std::to_string(experts) + " experts");
  }
  if (sum <= 0) return Invalid("--loads " + path + ": every load is 0");
  for (double& x : v) x /= sum;
  return v;
}

// The preset's own gate (with --gate-skew as the preset adds it) over random inputs: each
// expert's share of the top-k selections.
Result<std::vector<double>> SampledShares(const ModelFlags& f, DType dtype, int experts) {
  if (f.preset.empty()) return Invalid("--gate-skew applies to presets (give --loads for --model)");
  WeightSource src;
  src.preset = f.preset;
  src.experts = f.experts;
  src.gate_skew = f.gate_skew;
  src.dtype = dtype;
  MOERUN_ASSIGN_OR_RETURN(ModelSpec spec, SpecOf(src));
  if (spec.num_experts != experts) return Invalid("--gate-skew: the preset's expert count differs");
  MOERUN_ASSIGN_OR_RETURN(Isa isa, ChooseIsa(""));
  const CpuKernels& kernels = KernelsFor(isa);
  ThreadPool pool(0);
  MOERUN_ASSIGN_OR_RETURN(
      auto w, LoadWeights(src, spec, spec.FirstMoeLayer(),
                          std::vector<bool>(static_cast<size_t>(experts), false), kernels,
                          pool.size(), "gate"));
  Gating gating(w->Gate(), kernels, &pool);
  constexpr int64_t kTokens = 4096;
  const std::vector<float> x = RandomInput(kTokens, spec.hidden, 3);
  gating.Run(x.data(), kTokens);
  std::vector<double> share(static_cast<size_t>(experts), 0.0);
  for (int32_t id : gating.ids()) share[static_cast<size_t>(id)] += 1.0;
  for (double& s : share) s /= static_cast<double>(gating.ids().size());
  return share;
}

// The machine from a calibrated profile.
Result<MachineProfile> ReadProfile(const ModelFlags& f, DType dtype, int ranks, int expert_ranks,
                                   json* used) {
  std::ifstream in(f.profile);
  if (!in) return Invalid("--profile " + f.profile + ": cannot read");
  std::stringstream ss;
  ss << in.rdbuf();
  const json p = json::parse(ss.str(), nullptr, false);
  if (p.is_discarded() || !p.is_object() || p.value("format", "") != "moerun-perf-profile-v1") {
    return Invalid("--profile " + f.profile + ": not a profile of moebench calibrate");
  }
  const std::string name = DTypeName(dtype);
  if (!p.contains("kernels") || !p["kernels"].contains(name) || !p.contains("gate") ||
      !p.contains("combine") || !p.contains("machine")) {
    return Invalid("--profile " + f.profile + ": no kernel fit for " + name +
                   " (run moebench calibrate alone, with that --dtypes)");
  }
  MachineProfile m;
  const json& k = p["kernels"][name];
  m.kernel = {k.at("fixed_ns").get<double>(), k.at("row_ns").get<double>(),
              k.value("overhead_us", 0.0)};
  m.gate_fixed_us = p["gate"].at("fixed_us").get<double>();
  m.gate_mac_ns = p["gate"].at("mac_ns").get<double>();
  m.combine_value_ns = p["combine"].at("value_ns").get<double>();
  m.cores = p["machine"].at("cores").get<int>();
  m.threads = f.threads > 0 ? f.threads : p["machine"].at("threads").get<int>();
  const json* best = nullptr;
  const json none = json::array();
  for (const json& t : p.contains("transports") ? p["transports"] : none) {
    if (t.value("transport", "") != f.transport) continue;
    if (best == nullptr ||
        std::abs(t.value("ranks", 0) - ranks) < std::abs((*best).value("ranks", 0) - ranks)) {
      best = &t;
    }
  }
  if (best == nullptr) {
    return Invalid("--profile " + f.profile + ": no " + f.transport +
                   " transport measured (run moebench calibrate under mpirun --transport " +
                   f.transport + ")");
  }
  m.link = {best->at("latency_us").get<double>(), best->at("gbps").get<double>()};
  m.net = m.link;
  // Expert ranks computing at once: their time over the time alone (the F32 fit) at each
  // calibrated count n, fitted as a * n^b (b = 1 from a single count: time grows with the ranks
  // sharing the cores), read at this deployment's expert ranks.
  std::vector<double> ln_n, ln_phi;
  for (const json& t : p.contains("transports") ? p["transports"] : none) {
    if (t.value("transport", "") != f.transport || !t.contains("concurrent_kernel") ||
        !p["kernels"].contains("F32")) {
      continue;
    }
    const json& c = t["concurrent_kernel"];
    const json& f32 = p["kernels"]["F32"];
    const double alone_ms =
        c.at("experts").get<double>() * c.at("weights_per_expert").get<double>() *
        (f32.at("fixed_ns").get<double>() +
         c.at("rows_per_expert").get<double>() * f32.at("row_ns").get<double>()) /
        1e6;
    if (alone_ms > 0 && c.at("ms").get<double>() > 0) {
      ln_n.push_back(std::log(c.at("expert_ranks").get<double>()));
      ln_phi.push_back(std::log(c["ms"].get<double>() / alone_ms));
    }
  }
  if (!ln_n.empty()) {
    AffineFit fit = FitAffine(ln_n, ln_phi);
    if (fit.b == 0) fit = {ln_phi[0] - ln_n[0], 1.0};  // one count: a * n
    m.shared_factor = std::exp(fit.a + fit.b * std::log(std::max(1, expert_ranks)));
  }
  *used = {{"source", "profile " + f.profile},
           {"kernel", k},
           {"gate", p["gate"]},
           {"combine", p["combine"]},
           {"transport", *best},
           {"cores", m.cores},
           {"threads", m.threads},
           {"shared_factor", m.shared_factor}};
  (*used)["kernel"].erase("points");
  (*used)["gate"].erase("points");
  (*used)["transport"].erase("points");
  return m;
}

Result<MachineProfile> FromProfile(const ModelFlags& f, DType dtype, int ranks, int expert_ranks,
                                   json* used) {
  try {
    return ReadProfile(f, dtype, ranks, expert_ranks, used);
  } catch (const json::exception& e) {
    return Invalid("--profile " + f.profile + ": " + e.what());
  }
}

// The machine from a user's figures: a device's bandwidth and FLOP rate, the links.
MachineProfile FromFigures(const ModelFlags& f, DType dtype, json* used) {
  MachineProfile m;
  m.kernel.fixed_ns = WeightBytes(dtype) / f.device_gbps;  // bytes / (GB/s) = ns
  m.kernel.row_ns = 2e-3 / f.device_tflops;                // 2 FLOP per weight and row
  m.kernel.overhead_us = f.kernel_us;
  m.gate_fixed_us = f.kernel_us;
  m.gate_mac_ns = 2e-3 / f.device_tflops;
  m.combine_value_ns = 8.0 / f.device_gbps;  // F32 read and written once
  m.link = {f.link_us, f.link_gbps};
  m.net = {f.net_us > 0 ? f.net_us : f.link_us, f.net_gbps > 0 ? f.net_gbps : f.link_gbps};
  m.cores = 0;
  *used = {{"source", "figures"},
           {"device_gbps", f.device_gbps},
           {"device_tflops", f.device_tflops},
           {"kernel_us", f.kernel_us},
           {"link_gbps", m.link.gbps},
           {"link_us", m.link.latency_us},
           {"net_gbps", m.net.gbps},
           {"net_us", m.net.latency_us}};
  return m;
}

Status Check(const ModelFlags& f) {
  const bool figures = f.device_gbps > 0 || f.device_tflops > 0 || f.link_gbps > 0;
  if (f.profile.empty() == !figures) {
    return Invalid(
        "give --profile FILE or the figures --device-gbps, --device-tflops, --link-gbps, "
        "--link-us (one of the two)");
  }
  if (figures && (!(f.device_gbps > 0) || !(f.device_tflops > 0) || !(f.link_gbps > 0) ||
                  !(f.link_us >= 0) || f.ranks_per_node < 1 || f.nodes < 1)) {
    return Invalid(
        "figures need --device-gbps, --device-tflops, --link-gbps > 0, --link-us >= 0, "
        "--ranks-per-node >= 1 and --nodes >= 1");
  }
  if (!std::isfinite(f.net_gbps) || f.net_gbps < 0 || !std::isfinite(f.net_us) || f.net_us < 0 ||
      !std::isfinite(f.kernel_us) || f.kernel_us < 0) {
    return Invalid("--net-gbps, --net-us and --kernel-us must be >= 0");
  }
  if (f.tokens < 1 || f.tokens > (int64_t{1} << 30)) return Invalid("--tokens must be >= 1");
  if (f.microbatch_tokens < 0) return Invalid("--microbatch-tokens must be >= 0");
  if (f.routers < 1) return Invalid("--routers must be >= 1");
  if (!f.profile.empty() && f.ranks < f.routers + 1) {
    return Invalid("--ranks (routers included) must be at least --routers + 1");
  }
  if (!(f.activation_bytes > 0) || f.activation_bytes > 8) {
    return Invalid("--activation-bytes must be in (0, 8]");
  }
  if (!std::isfinite(f.rate) || f.rate < 0) return Invalid("--rate must be >= 0 requests/s");
  if (f.tokens_per_request < 1 || f.max_batch_tokens < 1 || !(f.max_wait_us >= 0) ||
      !(f.request_overhead_us >= 0)) {
    return Invalid("--tokens-per-request, --max-batch-tokens >= 1; --max-wait-us >= 0");
  }
  if (!std::isfinite(f.gate_skew) || f.gate_skew < 0 || f.gate_skew > 8) {
    return Invalid("--gate-skew must be in 0..8");
  }
  if (f.gate_skew > 0 && !f.loads.empty()) return Invalid("give --loads or --gate-skew, not both");
  return Status::Ok();
}

Result<json> Predict(const ModelFlags& f) {
  MOERUN_RETURN_IF_ERROR(Check(f));
  MOERUN_ASSIGN_OR_RETURN(DType dtype, ParseWeightDType(f.dtype));
  MOERUN_ASSIGN_OR_RETURN(ModelSpec spec, SpecFor(f, dtype));
  ModelShape shape;
  shape.hidden = spec.hidden;
  shape.expert_inter = spec.expert_inter;
  shape.shared_inter = spec.shared_inter;
  shape.experts = spec.num_experts;
  shape.top_k = spec.top_k;
  shape.weight_bytes = WeightBytes(dtype);
  shape.activation_bytes = f.activation_bytes;
  const int moe_layers =
      f.moe_layers > 0 ? f.moe_layers : std::max<int>(1, static_cast<int>(spec.moe_layers.size()));

  Deployment d;
  d.tokens = f.tokens;
  d.microbatch_tokens = f.microbatch_tokens;
  const bool figures = f.profile.empty();
  json machine;
  MachineProfile p;
  if (figures) {
    d.colocated = true;
    d.nodes = f.nodes;
    d.expert_ranks = f.nodes * f.ranks_per_node;
    d.routers = d.expert_ranks;  // every device routes its share of the batch
    p = FromFigures(f, dtype, &machine);
  } else {
    d.routers = f.routers;
    d.expert_ranks = f.ranks - f.routers;
    MOERUN_ASSIGN_OR_RETURN(p, FromProfile(f, dtype, f.ranks, d.expert_ranks, &machine));
  }
  // Routing shares per expert, then per slot of the placement.
  std::vector<double> share(static_cast<size_t>(spec.num_experts), 1.0 / spec.num_experts);
  std::string routing = "uniform";
  if (!f.loads.empty()) {
    MOERUN_ASSIGN_OR_RETURN(share, ReadLoads(f.loads, spec.num_experts));
    routing = "loads " + f.loads;
  } else if (f.gate_skew > 0) {
    MOERUN_ASSIGN_OR_RETURN(share, SampledShares(f, dtype, spec.num_experts));
    routing = "the preset's gate, skew " + std::to_string(f.gate_skew) + ", sampled";
  }
  // Co-located devices: a placement over one router and the devices as expert ranks.
  const int p_routers = figures ? 1 : d.routers;
  const int p_ranks = p_routers + d.expert_ranks;
  Result<Placement> placement = Placement::Make(f.placement, spec.num_experts, p_ranks, p_routers);
  if (!placement.ok()) return Invalid("--placement: " + placement.status().message());
  const LayerPlacement* lp = placement->Layer(spec.FirstMoeLayer());
  if (lp == nullptr) return Invalid("--placement has no entry for the model's MoE layer");
  d.slot_shares.assign(static_cast<size_t>(d.expert_ranks), {});
  for (int r = p_routers; r < p_ranks && r < static_cast<int>(lp->rank_slots.size()); ++r) {
    for (int slot : lp->rank_slots[static_cast<size_t>(r)]) {
      const int e = lp->slots[static_cast<size_t>(slot)].expert;
      d.slot_shares[static_cast<size_t>(r - p_routers)].push_back(
          share[static_cast<size_t>(e)] /
          static_cast<double>(lp->replicas[static_cast<size_t>(e)].size()));
    }
  }

  const LayerPrediction lay = PredictLayer(shape, p, d);
  json r;
  r["bench"] = "model";
  r["model"] = f.preset.empty() ? f.model : "preset:" + f.preset;
  r["layer"] = DescribeLayer(spec, spec.FirstMoeLayer(), dtype);
  r["experts"] = shape.experts;
  r["top_k"] = shape.top_k;
  r["hidden"] = shape.hidden;
  r["expert_intermediate"] = shape.expert_inter;
  r["shared_intermediate"] = shape.shared_inter;
  r["weight_dtype"] = DTypeName(dtype);
  r["weight_bytes_per_param"] = shape.weight_bytes;
  r["moe_layers"] = moe_layers;
  r["machine"] = machine;
  r["deployment"] = {{"routers", d.routers},
                     {"expert_ranks", d.expert_ranks},
                     {"nodes", d.nodes},
                     {"colocated", d.colocated},
                     {"transport", figures ? "figures" : f.transport},
                     {"placement", f.placement},
                     {"routing", routing},
                     {"tokens", d.tokens},
                     {"microbatch_tokens", lay.microbatch_tokens},
                     {"microbatches", lay.microbatches}};
  r["prediction"] = {{"gate_ms", lay.gate_ms},
                     {"dispatch_ms", lay.dispatch_ms},
                     {"expert_ms", lay.expert_ms},
                     {"combine_ms", lay.combine_ms},
                     {"parts_are", "per microbatch"},
                     {"oversubscribed", lay.oversubscribed},
                     {"expert_ms_per_rank", lay.expert_ms_per_rank},
                     {"rows_per_rank", lay.rows_per_rank},
                     {"layer_ms", lay.layer_ms},
                     {"tokens_per_s", lay.tokens_per_s},
                     {"moe_layers_ms", lay.layer_ms * moe_layers},
                     {"moe_layers_tokens_per_s", lay.tokens_per_s / moe_layers}};
  json mem = json::array();
  double most = 0;
  const std::vector<RankMemory> memory = MemoryPerRank(shape, d);
  for (size_t i = 0; i < memory.size(); ++i) {
    const RankMemory& m = memory[i];
    // The weights of every MoE layer (a rank holds its slots of each); the buffers once (the
    // layers run one after another and share them).
    const double gib = (m.weight_bytes * moe_layers + m.buffer_bytes) / double(1 << 30);
    most = std::max(most, gib);
    mem.push_back({{"role", m.router ? "router" : (d.colocated ? "router+expert" : "expert")},
                   {"weight_bytes_per_layer", m.weight_bytes},
                   {"buffer_bytes_per_layer", m.buffer_bytes},
                   {"gib_all_moe_layers", gib},
                   {"what", "weights of every MoE layer + one layer's buffers"}});
  }
  r["memory"] = {{"per_rank", mem}, {"max_gib_all_moe_layers", most}};
  if (f.rate > 0) {
    const ServedPrediction s =
        PredictServed(shape, p, d, f.rate, f.tokens_per_request, f.max_batch_tokens, f.max_wait_us,
                      f.request_overhead_us);
    r["served"] = {{"rate", f.rate},
                   {"tokens_per_request", f.tokens_per_request},
                   {"max_batch_tokens", f.max_batch_tokens},
                   {"max_wait_us", f.max_wait_us},
                   {"request_overhead_us", f.request_overhead_us},
                   {"saturated", s.saturated},
                   {"batch_tokens", s.batch_tokens},
                   {"batch_ms", s.batch_ms},
                   {"cycle_ms", s.cycle_ms},
                   {"p50_ms", s.saturated ? json() : json(s.p50_ms)},
                   {"p99_ms", s.saturated ? json() : json(s.p99_ms)},
                   {"tokens_per_s", s.tokens_per_s},
                   {"capacity_tokens_per_s", s.capacity_tokens_per_s}};
  }
  r["assumptions"] = {
      "expert time per expert = W * (fixed + rows * row) ns (fitted, or bytes/bandwidth and "
      "2 FLOP/(weight*row) at the given rate); fixed paid by each expert used",
      "the router posts its messages one after another: latency + bytes/bandwidth each; "
      "across nodes the off-node messages go concurrently with the on-node ones",
      "microbatches overlap the router's work with the experts' unless the ranks share "
      "oversubscribed cores or one device (then every part adds)",
      "oversubscribed cores run cores/threads ranks at a time: the node's expert work adds",
      "attention and everything outside the MoE layer is not modelled",
      "served: Poisson arrivals, one batcher cycle C = max(S(b), wait); p50 = C/2 + S, "
      "p99 = 0.99 C + S"};
  return r;
}

}  // namespace

int RunModel(const ModelFlags& f) {
  auto r = Predict(f);
  if (!r.ok()) return FailWith(r.status());
  const json& j = *r;
  const json& pr = j["prediction"];
  std::printf("%s\n", j.dump(2).c_str());
  std::fprintf(stderr,
               "model: %s, %lld tokens, %d expert ranks: gate %.3f + dispatch %.3f + experts %.3f "
               "+ combine %.3f ms (x%d microbatches) -> layer %.3f ms, %.0f tokens/s",
               j["layer"].get<std::string>().c_str(), static_cast<long long>(f.tokens),
               j["deployment"]["expert_ranks"].get<int>(), pr["gate_ms"].get<double>(),
               pr["dispatch_ms"].get<double>(), pr["expert_ms"].get<double>(),
               pr["combine_ms"].get<double>(), j["deployment"]["microbatches"].get<int>(),
               pr["layer_ms"].get<double>(), pr["tokens_per_s"].get<double>());
  if (j.contains("served")) {
    const json& s = j["served"];
    if (s["saturated"].get<bool>()) {
      std::fprintf(stderr, " | served at %.0f req/s: saturated (capacity %.0f tokens/s)", f.rate,
                   s["capacity_tokens_per_s"].get<double>());
    } else {
      std::fprintf(stderr, " | served at %.0f req/s: p50 %.2f ms, p99 %.2f ms", f.rate,
                   s["p50_ms"].get<double>(), s["p99_ms"].get<double>());
    }
  }
  std::fprintf(stderr, "\n");
  return 0;
}

}  // namespace moerun::bench
