#include "bench/transport_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "launch/layer_source.h"
#include "router/dispatch_plan.h"
#include "runtime/ep_protocol.h"
#include "runtime/log.h"
#include "transport/mpi/alltoallv_baseline.h"

namespace moerun::bench {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Top-k distinct experts per token, uniform, from a seed.
std::vector<int32_t> RandomRouting(int64_t tokens, int k, int experts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(tokens * k));
  std::vector<int32_t> pool(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    for (int j = 0; j < k; ++j) {
      std::uniform_int_distribution<int> d(j, experts - 1);
      std::swap(pool[static_cast<size_t>(j)], pool[static_cast<size_t>(d(rng))]);
      ids[static_cast<size_t>(t * k + j)] = pool[static_cast<size_t>(j)];
    }
  }
  return ids;
}

// Our dispatch + combine of a plan over the real protocol (header, rows, results), one round at
// a time, interleaved with the baseline so that both see the same machine.
class OurRoundTrip {
 public:
  OurRoundTrip(Transport* t, const DispatchPlan& plan, std::vector<int64_t> rows, int64_t hidden,
               size_t header_bytes)
      : t_(t), plan_(plan), rows_(std::move(rows)), hidden_(hidden), header_bytes_(header_bytes) {
    const int64_t total = t->rank() == 0 ? plan.rank_offset.back() : rows_[t->rank()];
    send_.assign(static_cast<size_t>(total * hidden), 1.0f);
    recv_.assign(static_cast<size_t>(total * hidden), 0.0f);
    headers_.assign(header_bytes * static_cast<size_t>(t->size()), 0);
  }

  // The router's milliseconds (0 on other ranks).
  Result<double> Run() {
    const auto deadline = DeadlineIn(std::chrono::seconds(120));
    const size_t row_bytes = static_cast<size_t>(hidden_) * sizeof(float);
    MOERUN_RETURN_IF_ERROR(t_->Barrier(deadline));
    const auto t0 = Clock::now();
    reqs_.clear();
    if (t_->rank() == 0) {
      for (int d = 1; d < t_->size(); ++d) {
        const int64_t r = rows_[static_cast<size_t>(d)];
        if (r == 0) continue;
        const int64_t off = plan_.rank_offset[static_cast<size_t>(d)];
        MOERUN_ASSIGN_OR_RETURN(Request rr, t_->Irecv(d, kTagResult, recv_.data() + off * hidden_,
                                                      static_cast<size_t>(r) * row_bytes));
        reqs_.push_back(rr);
        char* h = headers_.data() + header_bytes_ * static_cast<size_t>(d);
        EpHeaderFixed fixed;
        fixed.kind = static_cast<uint32_t>(EpKind::kDispatch);
        fixed.rows = r;
        std::memcpy(h, &fixed, sizeof fixed);
        MOERUN_ASSIGN_OR_RETURN(Request hr, t_->Isend(d, kTagHeader, h, header_bytes_));
        reqs_.push_back(hr);
        MOERUN_ASSIGN_OR_RETURN(Request sr, t_->Isend(d, kTagRows, send_.data() + off * hidden_,
                                                      static_cast<size_t>(r) * row_bytes));
        reqs_.push_back(sr);
      }
      MOERUN_RETURN_IF_ERROR(t_->WaitAll(reqs_, deadline, "dispatch + combine"));
      return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    }
    const int64_t mine = rows_[static_cast<size_t>(t_->rank())];
    if (mine > 0) {
      MOERUN_RETURN_IF_ERROR(t_->Recv(0, kTagHeader, headers_.data(), header_bytes_, deadline));
      MOERUN_RETURN_IF_ERROR(
          t_->Recv(0, kTagRows, recv_.data(), static_cast<size_t>(mine) * row_bytes, deadline));
      MOERUN_RETURN_IF_ERROR(
          t_->Send(0, kTagResult, recv_.data(), static_cast<size_t>(mine) * row_bytes, deadline));
    }
    return 0.0;
  }

 private:
  Transport* t_;
  const DispatchPlan& plan_;
  std::vector<int64_t> rows_;
  int64_t hidden_;
  size_t header_bytes_;
  std::vector<float> send_, recv_;
  std::vector<char> headers_;
  std::vector<Request> reqs_;
};

// A whole layer (gate, dispatch, experts, combine) of the benchmark's shape; median ms.
Result<double> TimeLayer(JobLaunch& job, const TransportBenchFlags& f, int64_t tokens,
                         int64_t microbatch) {
  JobOptions opts;
  job.Fill(&opts);
  opts.ep.microbatch_tokens = microbatch;
  ModelSpec s;
  s.family = Family::kQwen3Moe;
  s.hidden = f.hidden;
  s.num_layers = 1;
  s.moe_layers = {0};
  s.num_experts = f.experts;
  s.top_k = f.topk;
  s.expert_inter = f.inter > 0 ? f.inter : std::max<int64_t>(16, f.hidden / 8);
  s.shared_inter = f.shared_inter;
  s.gate.num_experts = s.num_experts;
  s.gate.top_k = s.top_k;
  opts.source.spec = s;
  opts.source.seed = f.seed;
  opts.layers = {0};
  opts.isa = BestIsa();
  std::vector<float> x(static_cast<size_t>(tokens * f.hidden));
  std::mt19937 rng(static_cast<uint32_t>(f.seed));
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  for (auto& v : x) v = d(rng);
  std::vector<float> out(x.size());
  std::vector<double> ms;
  const RouterWork work = [&](int rank, std::map<int, ExpertParallelLayer*>& layers) -> Status {
    if (rank != 0) return Status::Ok();
    for (int it = -1; it < std::max(3, f.iters / 4); ++it) {
      const auto t0 = Clock::now();
      MOERUN_RETURN_IF_ERROR(layers.at(0)->Forward(x.data(), tokens, out.data()));
      if (it >= 0)
        ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    return Status::Ok();
  };
  MOERUN_RETURN_IF_ERROR(job.Run(opts, work));
  return Median(ms);
}

}  // namespace

int RunTransportBench(const TransportBenchFlags& f) {
  auto launched = JobLaunch::Create(f.launch);
  if (!launched.ok()) return FailWith(launched.status());
  JobLaunch& job = **launched;
  const int n = job.size();
  if (n < 2) {
    return FailWith(
        Status::InvalidArgument("moebench transport needs at least 2 ranks (mpirun -np N, or "
                                "--transport inproc --ranks N)"));
  }
  if (f.hidden <= 0 || f.hidden > (1 << 20) || f.topk <= 0 || f.experts < f.topk ||
      f.experts > 65536 || f.iters <= 0 || f.iters > 100000) {
    return FailWith(Status::InvalidArgument("bad --hidden/--topk/--experts/--iters"));
  }
  const int64_t row_bytes = f.hidden * 4;
  int64_t tokens = f.tokens;
  if (tokens <= 0 && f.bytes_per_peer > 0) {
    tokens = std::max<int64_t>(
        1, (f.bytes_per_peer * (n - 1) + row_bytes * f.topk - 1) / (row_bytes * f.topk));
  }
  if (tokens <= 0 || tokens > (1 << 22)) {
    return FailWith(Status::InvalidArgument("give --tokens (1..4194304) or --bytes-per-peer"));
  }

  auto placement = Placement::Linear(f.experts, n, 1);
  if (!placement.ok()) return FailWith(placement.status());
  const LayerPlacement& lp = *placement->Layer(0);
  // The same plan on every rank (same seed), so each knows its byte counts.
  const auto ids = RandomRouting(tokens, f.topk, f.experts, f.seed);
  std::vector<double> load(static_cast<size_t>(n), 0.0);
  DispatchPlan plan;
  plan.Build(ids.data(), tokens, f.topk, lp, load);
  std::vector<int64_t> rows(static_cast<size_t>(n));
  for (int d = 0; d < n; ++d) rows[static_cast<size_t>(d)] = plan.rows_to(d);
  const size_t header_bytes = HeaderBytes(*placement, {0});

  json report;
  report["bench"] = "transport";
  report["transport"] = job.transport();
  report["ranks"] = n;
  report["tokens"] = tokens;
  report["hidden"] = f.hidden;
  report["topk"] = f.topk;
  report["experts"] = f.experts;
  int64_t most = 0, sum = 0;
  for (int d = 1; d < n; ++d) {
    most = std::max(most, rows[static_cast<size_t>(d)] * row_bytes);
    sum += rows[static_cast<size_t>(d)] * row_bytes;
  }
  report["bytes_per_peer_mean"] = static_cast<double>(sum) / (n - 1);
  report["bytes_per_peer_max"] = most;

  // Our dispatch + combine, on the job's MPI endpoint (the baseline is MPI's own collective).
  if (job.transport() != "mpi") {
    return FailWith(
        Status::Unsupported("moebench transport compares against MPI_Alltoallv: run "
                            "it under mpirun with --transport mpi"));
  }
  std::vector<int64_t> send(static_cast<size_t>(n), 0), recv(static_cast<size_t>(n), 0);
  if (job.rank() == 0) {
    for (int d = 1; d < n; ++d)
      send[static_cast<size_t>(d)] = rows[static_cast<size_t>(d)] * row_bytes;
  } else {
    recv[0] = rows[static_cast<size_t>(job.rank())] * row_bytes;
  }
  auto baseline = AlltoallvBaseline::Create(send, recv);
  if (!baseline.ok()) return FailWith(baseline.status());
  OurRoundTrip round(job.mpi_transport(), plan, rows, f.hidden, header_bytes);
  std::vector<double> ours_ms, raw_ms;
  for (int it = -2; it < f.iters; ++it) {  // two warm-up rounds of each
    auto o = round.Run();
    if (!o.ok()) return FailWith(o.status());
    const double r = (*baseline)->RoundTripMs();
    if (it >= 0) {
      ours_ms.push_back(*o);
      raw_ms.push_back(r);
    }
  }
  const Result<double> ours = Median(ours_ms);
  const Result<double> raw = Median(raw_ms);
  if (job.rank() == 0) {
    report["ours_ms"] = *ours;
    report["alltoallv_ms"] = *raw;
    report["efficiency_vs_alltoallv"] = *raw / *ours;
    report["ours_gbps"] = 2.0 * static_cast<double>(sum) / (*ours * 1e6);
    std::fprintf(stderr,
                 "transport %s %d ranks: %lld tokens, %.2f MiB per peer: dispatch+combine %.3f ms "
                 "(%.2f GB/s), MPI_Alltoallv %.3f ms -> efficiency_vs_alltoallv %.2f\n",
                 job.transport().c_str(), n, static_cast<long long>(tokens),
                 static_cast<double>(sum) / (n - 1) / (1 << 20), *ours,
                 report["ours_gbps"].get<double>(), *raw, *raw / *ours);
  }

  if (f.layer) {
    const int64_t mb =
        f.microbatch_tokens > 0 ? f.microbatch_tokens : std::max<int64_t>(1, tokens / 4);
    auto plain = TimeLayer(job, f, tokens, 0);
    if (!plain.ok()) return FailWith(plain.status());
    auto overlapped = TimeLayer(job, f, tokens, mb);
    if (!overlapped.ok()) return FailWith(overlapped.status());
    if (job.rank() == 0) {
      report["layer"] = {
          {"expert_intermediate", f.inter > 0 ? f.inter : std::max<int64_t>(16, f.hidden / 8)},
          {"shared_intermediate", f.shared_inter},
          {"ms_one_microbatch", *plain},
          {"ms_overlapped", *overlapped},
          {"microbatch_tokens", mb},
          {"overlap_gain", *plain / *overlapped}};
      std::fprintf(stderr,
                   "layer: %.3f ms as one microbatch, %.3f ms in microbatches of %lld -> "
                   "overlap_gain %.2f\n",
                   *plain, *overlapped, static_cast<long long>(mb), *plain / *overlapped);
    }
  }
  if (job.rank() == 0 && f.json) std::printf("%s\n", report.dump(2).c_str());
  return 0;
}

}  // namespace moerun::bench
