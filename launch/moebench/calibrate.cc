#include "launch/moebench/calibrate.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <thread>

#include "base/exit_code.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "experts/cpu/grouped_ffn.h"
#include "experts/cpu/isa.h"
#include "launch/layer_flags.h"
#include "launch/moebench/layer_bench.h"
#include "launch/moebench/perf_model.h"
#include "launch/moebench/timing.h"
#include "router/combine.h"
#include "router/gating.h"
#include "runtime/ep/protocol.h"
#include "runtime/model/weight_source.h"

namespace moerun::bench {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// The grouped FFN over `experts` experts of the preset in `dtype`, `rows` rows each, at each
// rows value: ns per expert weight, fitted as fixed + rows * row.
Result<json> CalibrateKernel(const CalibrateFlags& f, const std::string& dtype,
                             const std::vector<int64_t>& rows_list, const CpuKernels& kernels,
                             ThreadPool* pool, double min_s) {
  LayerFlags lf;
  lf.preset = f.preset;
  lf.experts = f.experts;
  lf.dtype = dtype;
  MOERUN_ASSIGN_OR_RETURN(auto w, LoadLayerFromFlags(lf, kernels, pool->size()));
  const ModelSpec& s = w->spec;
  const ActParams act = s.RoutedAct(w->layer);
  const int e_count = s.num_experts;
  const double weights = 3.0 * static_cast<double>(s.hidden) * static_cast<double>(s.expert_inter);
  GroupedFfn ffn(kernels, pool);
  json points = json::array();
  std::vector<double> xs, ys;
  // Three rounds over the rows values, each point the median of its rounds: a burst of other
  // work on a shared machine spoils one round of a point, not the fit.
  constexpr int kRounds = 3;
  std::vector<std::vector<double>> rounds(rows_list.size());
  for (int round = 0; round < kRounds; ++round) {
    for (size_t i = 0; i < rows_list.size(); ++i) {
      const int64_t r = rows_list[i];
      const int64_t total = r * e_count;
      std::vector<ExpertGroup> groups;
      for (int e = 0; e < e_count; ++e) {
        groups.push_back(ExpertGroup{&w->experts[static_cast<size_t>(e)], act, e * r, r});
      }
      const std::vector<float> x = RandomInput(total, s.hidden, 7 + static_cast<uint64_t>(r));
      std::vector<int32_t> row_token(static_cast<size_t>(total));
      std::iota(row_token.begin(), row_token.end(), 0);
      const int64_t ldy = ffn.PaddedHidden(s.hidden);
      std::vector<float> y(static_cast<size_t>(total * ldy));
      const Timing t = TimeIt(
          [&] { ffn.Run(groups, x.data(), s.hidden, row_token.data(), y.data(), ldy); }, 3, min_s);
      rounds[i].push_back(t.median_ms / e_count);
    }
  }
  for (size_t i = 0; i < rows_list.size(); ++i) {
    const int64_t r = rows_list[i];
    const double ms = Median(rounds[i]);
    const double ns_per_weight = ms * 1e6 / weights;
    points.push_back({{"rows_per_expert", r},
                      {"ms_per_expert", ms},
                      {"ms_per_expert_rounds", rounds[i]},
                      {"ns_per_weight", ns_per_weight}});
    xs.push_back(static_cast<double>(r));
    ys.push_back(ns_per_weight);
    std::fprintf(stderr, "calibrate: %s kernel, %lld rows per expert: %.3f ms per expert\n",
                 DTypeName(w->dtype), static_cast<long long>(r), ms);
  }
  const AffineFit fit = FitAffine(xs, ys);
  return json{{"weight_dtype", DTypeName(w->dtype)}, {"fixed_ns", std::max(0.0, fit.a)},
              {"row_ns", std::max(0.0, fit.b)},      {"overhead_us", 0.0},
              {"shape", DescribeLayer(*w)},          {"points", points}};
}

// The gate of the preset's full expert count (no experts loaded) over several token counts:
// fixed + ns per multiply-add (tokens * experts * hidden).
Result<json> CalibrateGate(const CalibrateFlags& f, const std::vector<int64_t>& tokens_list,
                           const CpuKernels& kernels, ThreadPool* pool, double min_s) {
  WeightSource src;
  src.preset = f.preset;
  MOERUN_ASSIGN_OR_RETURN(ModelSpec spec, SpecOf(src));
  const int layer = spec.FirstMoeLayer();
  MOERUN_ASSIGN_OR_RETURN(
      auto w,
      LoadWeights(src, spec, layer, std::vector<bool>(static_cast<size_t>(spec.num_experts), false),
                  kernels, pool->size(), "gate"));
  Gating gating(w->Gate(), kernels, pool);
  json points = json::array();
  std::vector<double> xs, ys;
  for (int64_t t : tokens_list) {
    const std::vector<float> x = RandomInput(t, spec.hidden, 11 + static_cast<uint64_t>(t));
    const Timing tm = TimeIt([&] { gating.Run(x.data(), t); }, 3, min_s);
    const double macs =
        static_cast<double>(t) * spec.num_experts * static_cast<double>(spec.hidden);
    points.push_back({{"tokens", t}, {"ms", tm.median_ms}, {"macs", macs}});
    xs.push_back(macs);
    ys.push_back(tm.median_ms);
  }
  const AffineFit fit = FitAffine(xs, ys);
  return json{{"fixed_us", std::max(0.0, fit.a * 1e3)},
              {"mac_ns", std::max(0.0, fit.b * 1e6)},
              {"experts", spec.num_experts},
              {"hidden", spec.hidden},
              {"points", points}};
}

// Combine of `tokens` tokens of k = 8 rows of `hidden`: ns per value.
json CalibrateCombine(int64_t tokens, int64_t hidden, double min_s) {
  constexpr int k = 8;
  const std::vector<float> rows = RandomInput(tokens * k, hidden, 5);
  std::vector<float> out(static_cast<size_t>(tokens * hidden));
  const std::vector<float> w(k, 0.125f);
  const Timing tm = TimeIt(
      [&] {
        for (int64_t t = 0; t < tokens; ++t) {
          const float* ptrs[k];
          for (int s = 0; s < k; ++s) ptrs[s] = rows.data() + (t * k + s) * hidden;
          CombineToken(k, hidden, ptrs, w.data(), nullptr, 0.0f, out.data() + t * hidden);
        }
      },
      3, min_s);
  const double values = static_cast<double>(tokens) * k * static_cast<double>(hidden);
  return {{"value_ns", tm.median_ms * 1e6 / values},
          {"tokens", tokens},
          {"top_k", k},
          {"hidden", hidden},
          {"ms", tm.median_ms}};
}

// Rank 0 sends `bytes` to every other rank, each sends them back; rank 0's median ms per round.
Result<double> RoundTrip(Transport* t, size_t bytes, int iters) {
  const auto deadline = DeadlineIn(std::chrono::seconds(120));
  const int n = t->size();
  std::vector<char> send(bytes * static_cast<size_t>(n), 1), recv(bytes * static_cast<size_t>(n));
  std::vector<double> ms;
  for (int it = -1; it < iters; ++it) {
    MOERUN_RETURN_IF_ERROR(t->Barrier(deadline));
    const auto t0 = Clock::now();
    if (t->rank() == 0) {
      std::vector<Request> reqs;
      for (int d = 1; d < n; ++d) {
        char* in = recv.data() + bytes * static_cast<size_t>(d);
        MOERUN_ASSIGN_OR_RETURN(Request r, t->Irecv(d, kTagResult, in, bytes));
        reqs.push_back(r);
        const char* out = send.data() + bytes * static_cast<size_t>(d);
        MOERUN_ASSIGN_OR_RETURN(Request s, t->Isend(d, kTagRows, out, bytes));
        reqs.push_back(s);
      }
      MOERUN_RETURN_IF_ERROR(t->WaitAll(reqs, deadline, "calibrate round trip"));
      if (it >= 0) {
        ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
    } else {
      MOERUN_RETURN_IF_ERROR(t->Recv(0, kTagRows, recv.data(), bytes, deadline));
      MOERUN_RETURN_IF_ERROR(t->Send(0, kTagResult, recv.data(), bytes, deadline));
    }
  }
  MOERUN_RETURN_IF_ERROR(t->Barrier(deadline));
  return Median(ms);
}

// The transport part: rank 0's fit over the message sizes (null json on other ranks).
// Every rank but rank 0 (which waits as a router does) runs the same grouped FFN at once: F32,
// the preset's `experts` experts, 16 rows each. The median ms of the ranks' median times: with
// the kernel fit, the model reads from it how much slower ranks that share this machine's cores
// compute than the sum of their times alone.
Result<double> ConcurrentKernelMs(Transport* t, const CalibrateFlags& f, json* shape) {
  const auto deadline = DeadlineIn(std::chrono::seconds(300));
  double mine = 0;
  if (t->rank() != 0) {
    MOERUN_ASSIGN_OR_RETURN(Isa isa, ChooseIsa(""));
    const CpuKernels& kernels = KernelsFor(isa);
    ThreadPool pool(f.threads);
    LayerFlags lf;
    lf.preset = f.preset;
    lf.experts = f.experts;
    MOERUN_ASSIGN_OR_RETURN(auto w, LoadLayerFromFlags(lf, kernels, pool.size()));
    const ModelSpec& s = w->spec;
    constexpr int64_t kRows = 16;
    std::vector<ExpertGroup> groups;
    for (int e = 0; e < s.num_experts; ++e) {
      groups.push_back(ExpertGroup{&w->experts[static_cast<size_t>(e)], s.RoutedAct(w->layer),
                                   e * kRows, kRows});
    }
    const int64_t total = kRows * s.num_experts;
    const std::vector<float> x = RandomInput(total, s.hidden, 9);
    std::vector<int32_t> row_token(static_cast<size_t>(total));
    std::iota(row_token.begin(), row_token.end(), 0);
    GroupedFfn ffn(kernels, &pool);
    const int64_t ldy = ffn.PaddedHidden(s.hidden);
    std::vector<float> y(static_cast<size_t>(total * ldy));
    MOERUN_RETURN_IF_ERROR(t->Barrier(deadline));
    mine = TimeIt([&] { ffn.Run(groups, x.data(), s.hidden, row_token.data(), y.data(), ldy); }, 5,
                  0.5)
               .median_ms;
    // The ranks that finish first wait here as an idle expert rank waits (the transport's
    // polling), not in the launcher's teardown.
    MOERUN_RETURN_IF_ERROR(t->Barrier(deadline));
    MOERUN_RETURN_IF_ERROR(t->Send(0, kTagResult, &mine, sizeof mine, deadline));
    return 0.0;
  }
  MOERUN_RETURN_IF_ERROR(t->Barrier(deadline));
  MOERUN_RETURN_IF_ERROR(t->Barrier(deadline));
  std::vector<double> all;
  for (int r = 1; r < t->size(); ++r) {
    MOERUN_RETURN_IF_ERROR(t->Recv(r, kTagResult, &mine, sizeof mine, deadline));
    all.push_back(mine);
  }
  WeightSource src;
  src.preset = f.preset;
  src.experts = f.experts;
  MOERUN_ASSIGN_OR_RETURN(ModelSpec spec, SpecOf(src));
  *shape = {{"weight_dtype", "F32"},
            {"experts", spec.num_experts},
            {"rows_per_expert", 16},
            {"weights_per_expert", 3 * spec.hidden * spec.expert_inter},
            {"expert_ranks", t->size() - 1}};
  return Median(all);
}

Result<json> CalibrateTransport(JobLaunch& job, const CalibrateFlags& f) {
  const bool quick = f.quick;
  const std::vector<size_t> sizes =
      quick ? std::vector<size_t>{4096, 262144}
            : std::vector<size_t>{4096, 65536, 262144, 1048576, 4194304};
  const int iters = quick ? 5 : 15;
  json result;
  Status failed;
  const JobLaunch::RankMain rank_main = [&](Transport* t) -> Status {
    const int peers = t->size() - 1;
    std::vector<double> xs, ys;
    json points = json::array();
    for (size_t b : sizes) {
      MOERUN_ASSIGN_OR_RETURN(double ms, RoundTrip(t, b, iters));
      if (t->rank() != 0) continue;
      const double total = 2.0 * peers * static_cast<double>(b);  // both directions
      points.push_back({{"bytes_per_message", b}, {"round_trip_ms", ms}});
      xs.push_back(total);
      ys.push_back(ms);
      std::fprintf(stderr, "calibrate: %s, %d ranks, %zu bytes to each: %.3f ms round trip\n",
                   t->name(), t->size(), b, ms);
    }
    json shape;
    MOERUN_ASSIGN_OR_RETURN(double conc_ms, ConcurrentKernelMs(t, f, &shape));
    if (t->rank() == 0) {
      shape["ms"] = conc_ms;
      std::fprintf(stderr, "calibrate: %d expert ranks computing at once: %.3f ms each\n",
                   t->size() - 1, conc_ms);
      const AffineFit fit = FitAffine(xs, ys);
      // a: 2 * peers messages' latency; b: ms per byte.
      result = {{"transport", job.transport()},
                {"ranks", t->size()},
                {"latency_us", std::max(0.0, fit.a * 1e3 / (2.0 * peers))},
                {"gbps", fit.b > 0 ? 1.0 / (fit.b * 1e6) : 1e9},
                {"concurrent_kernel", shape},
                {"points", points}};
    }
    return Status::Ok();
  };
  MOERUN_RETURN_IF_ERROR(job.Run(rank_main));
  return result;
}

// The profile already at `path` (an empty object if there is none).
Result<json> ReadProfile(const std::string& path) {
  std::error_code ec;
  if (path.empty() || !std::filesystem::exists(path, ec)) return json::object();
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::InvalidArgument("--out " + path + ": exists and is not a JSON profile");
  }
  return j;
}

}  // namespace

int RunCalibrate(const CalibrateFlags& f) {
  if (f.experts < 1 || f.experts > 64) {
    return FailWith(Status::InvalidArgument("--experts must be in 1..64"));
  }
  auto profile = ReadProfile(f.out);
  if (!profile.ok()) return FailWith(profile.status());
  json& p = *profile;
  p["format"] = "moerun-perf-profile-v1";
  auto launched = JobLaunch::Create(f.launch);
  if (!launched.ok()) return FailWith(launched.status());
  JobLaunch& job = **launched;
  if (job.size() > 1) {
    auto r = CalibrateTransport(job, f);
    if (!r.ok()) return FailWith(r.status());
    if (job.rank() != 0) return 0;
    json kept = json::array();
    for (const json& e : p.value("transports", json::array())) {
      if (e.value("transport", "") != (*r)["transport"] || e.value("ranks", 0) != (*r)["ranks"]) {
        kept.push_back(e);
      }
    }
    kept.push_back(*r);
    p["transports"] = kept;
  } else {
    auto isa = ChooseIsa("");
    if (!isa.ok()) return FailWith(isa.status());
    const CpuKernels& kernels = KernelsFor(*isa);
    ThreadPool pool(f.threads);
    const double min_s = f.quick ? 0.02 : 0.3;
    const std::vector<int64_t> rows =
        f.quick ? std::vector<int64_t>{1, 16} : std::vector<int64_t>{1, 4, 16, 64};
    json kernels_json = p.value("kernels", json::object());
    std::stringstream ss(f.dtypes);
    std::string item;
    while (std::getline(ss, item, ',')) {
      auto k = CalibrateKernel(f, item, rows, kernels, &pool, min_s);
      if (!k.ok()) return FailWith(k.status());
      kernels_json[(*k)["weight_dtype"].get<std::string>()] = *k;
    }
    p["kernels"] = kernels_json;
    const std::vector<int64_t> gate_tokens =
        f.quick ? std::vector<int64_t>{16, 128} : std::vector<int64_t>{16, 64, 256, 1024};
    auto g = CalibrateGate(f, gate_tokens, kernels, &pool, min_s);
    if (!g.ok()) return FailWith(g.status());
    p["gate"] = *g;
    p["combine"] = CalibrateCombine(f.quick ? 32 : 256, (*g)["hidden"].get<int64_t>(), min_s);
    p["machine"] = {{"cpu", DetectCpu().brand},
                    {"isa", IsaName(*isa)},
                    {"cores", static_cast<int>(std::thread::hardware_concurrency())},
                    {"threads", pool.size()}};
  }
  if (!f.out.empty()) {
    std::ofstream out(f.out);
    out << p.dump(2) << "\n";
    if (!out) return FailWith(Status::InvalidArgument("--out " + f.out + ": cannot write"));
  }
  std::printf("%s\n", p.dump(2).c_str());
  return 0;
}

}  // namespace moerun::bench
