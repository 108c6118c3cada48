#include "launch/moebench/transport_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "base/exit_code.h"
#include "base/log.h"
#include "launch/layer_flags.h"
#include "launch/moebench/baselines/baselines.h"
#include "launch/moebench/timing.h"
#include "router/dispatch_plan.h"
#include "runtime/ep/protocol.h"
#include "transport/registry.h"

namespace moerun::bench {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

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
// a time, interleaved with the baselines so that all see the same machine. The row buffers are
// registered with the transport once, at construction (as the runtime's EP layer does), so an
// RDMA backend writes them directly and registers nothing on the timed path.
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
  ~OurRoundTrip() {
    t_->UnregisterMemory(send_.data());
    t_->UnregisterMemory(recv_.data());
  }
  OurRoundTrip(const OurRoundTrip&) = delete;
  OurRoundTrip& operator=(const OurRoundTrip&) = delete;

  Status Register() {
    MOERUN_RETURN_IF_ERROR(t_->RegisterMemory(send_.data(), send_.size() * sizeof(float)));
    return t_->RegisterMemory(recv_.data(), recv_.size() * sizeof(float));
  }

  // Row and result bytes this rank has sent, and how many of them the transport sent eagerly
  // (through its bounce buffers: measured around each row message's Isend, where the ucx
  // transport counts an eager send; a put is counted later, as put_bytes).
  uint64_t payload_bytes_sent() const { return payload_sent_; }
  uint64_t payload_eager_bytes() const { return payload_eager_; }

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
        MOERUN_ASSIGN_OR_RETURN(Request sr, SendPayload(d, kTagRows, send_.data() + off * hidden_,
                                                        static_cast<size_t>(r) * row_bytes));
        reqs_.push_back(sr);
      }
      MOERUN_RETURN_IF_ERROR(t_->WaitAll(reqs_, deadline, "dispatch + combine"));
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      MOERUN_RETURN_IF_ERROR(t_->Barrier(deadline));
      return ms;
    }
    const int64_t mine = rows_[static_cast<size_t>(t_->rank())];
    if (mine > 0) {
      MOERUN_RETURN_IF_ERROR(t_->Recv(0, kTagHeader, headers_.data(), header_bytes_, deadline));
      MOERUN_RETURN_IF_ERROR(
          t_->Recv(0, kTagRows, recv_.data(), static_cast<size_t>(mine) * row_bytes, deadline));
      MOERUN_ASSIGN_OR_RETURN(Request sr, SendPayload(0, kTagResult, recv_.data(),
                                                      static_cast<size_t>(mine) * row_bytes));
      MOERUN_RETURN_IF_ERROR(t_->Wait(sr, deadline, "send"));
    }
    // Untimed: a completed send of the ucx transport may still have its FIN note queued in UCX,
    // which leaves only while this rank progresses the transport; the barrier keeps every rank
    // progressing it until the router has everything (the runtime's expert loop always does).
    MOERUN_RETURN_IF_ERROR(t_->Barrier(deadline));
    return 0.0;
  }

 private:
  Result<Request> SendPayload(int peer, int tag, const void* p, size_t bytes) {
    const uint64_t eager0 = t_->counters().eager_bytes;
    Result<Request> r = t_->Isend(peer, tag, p, bytes);
    payload_eager_ += t_->counters().eager_bytes - eager0;
    payload_sent_ += bytes;
    return r;
  }

  Transport* t_;
  const DispatchPlan& plan_;
  std::vector<int64_t> rows_;
  int64_t hidden_;
  size_t header_bytes_;
  std::vector<float> send_, recv_;
  std::vector<char> headers_;
  std::vector<Request> reqs_;
  uint64_t payload_sent_ = 0, payload_eager_ = 0;
};

// What one rank's transport did over the timed rounds (counter deltas), as sent to rank 0.
struct ZeroCopyTally {
  uint64_t put_bytes = 0, eager_bytes = 0, copied_bytes = 0, registrations = 0,
           on_demand_registrations = 0, payload_bytes = 0, payload_eager_bytes = 0;
  static ZeroCopyTally Of(const Transport& t, const OurRoundTrip& r) {
    const TransportCounters c = t.counters();
    return {c.put_bytes,
            c.eager_bytes,
            c.copied_bytes,
            c.registrations,
            c.on_demand_registrations,
            r.payload_bytes_sent(),
            r.payload_eager_bytes()};
  }
  ZeroCopyTally Minus(const ZeroCopyTally& o) const {
    return {put_bytes - o.put_bytes,
            eager_bytes - o.eager_bytes,
            copied_bytes - o.copied_bytes,
            registrations - o.registrations,
            on_demand_registrations - o.on_demand_registrations,
            payload_bytes - o.payload_bytes,
            payload_eager_bytes - o.payload_eager_bytes};
  }
  void Add(const ZeroCopyTally& o) {
    put_bytes += o.put_bytes;
    eager_bytes += o.eager_bytes;
    copied_bytes += o.copied_bytes;
    registrations += o.registrations;
    on_demand_registrations += o.on_demand_registrations;
    payload_bytes += o.payload_bytes;
    payload_eager_bytes += o.payload_eager_bytes;
  }
  json ToJson() const {
    return {{"put_bytes", put_bytes},
            {"eager_bytes", eager_bytes},
            {"copied_bytes", copied_bytes},
            {"registrations_during_timing", registrations},
            {"on_demand_registrations_during_timing", on_demand_registrations},
            {"payload_bytes", payload_bytes},
            {"payload_eager_bytes", payload_eager_bytes}};
  }
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
  const RouterWork work = [&](RouterRank& router) -> Status {
    if (router.rank() != 0) return Status::Ok();
    for (int it = -1; it < std::max(3, f.iters / 4); ++it) {
      const auto t0 = Clock::now();
      MOERUN_RETURN_IF_ERROR(router.layer(0)->Forward(x.data(), tokens, out.data()));
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

  // Our dispatch + combine on the job's endpoint (mpi, or ucx bootstrapped over MPI), against
  // MPI's own collective; under ucx also against a raw ucp_put_nbx loop over the same bytes and
  // against our protocol over a plain mpi transport, all in the same run, round by round.
  const bool ucx = job.transport() == "ucx";
  if (job.transport() != "mpi" && !ucx) {
    return FailWith(Status::Unsupported(
        "moebench transport compares against MPI_Alltoallv (and, for ucx, a raw ucp_put_nbx "
        "loop): run it under mpirun with --transport mpi or --transport ucx"));
  }
  std::vector<int64_t> send(static_cast<size_t>(n), 0), recv(static_cast<size_t>(n), 0);
  if (job.rank() == 0) {
    for (int d = 1; d < n; ++d)
      send[static_cast<size_t>(d)] = rows[static_cast<size_t>(d)] * row_bytes;
  } else {
    recv[0] = rows[static_cast<size_t>(job.rank())] * row_bytes;
  }
  {
    auto baseline = CreateBaseline("mpi_alltoallv", nullptr, send, recv);
    if (!baseline.ok()) return FailWith(baseline.status());
    Transport* const t = job.mpi_transport();
    OurRoundTrip round(t, plan, rows, f.hidden, header_bytes);
    if (Status s = round.Register(); !s.ok()) return FailWith(s);
    // ucx only: a second, plain mpi transport (our protocol over it, and the raw baseline's
    // bootstrap, so that the ucx transport's counters see our rounds alone) and the raw loop.
    std::unique_ptr<Transport> plain_mpi;
    std::unique_ptr<OurRoundTrip> mpi_round;
    std::unique_ptr<RoundTripBaseline> raw_put;
    size_t put_min = 0;
    if (ucx) {
      auto m = CreateTransport("mpi");
      if (!m.ok()) return FailWith(m.status());
      plain_mpi = std::move(*m);
      mpi_round =
          std::make_unique<OurRoundTrip>(plain_mpi.get(), plan, rows, f.hidden, header_bytes);
      if (Status s = mpi_round->Register(); !s.ok()) return FailWith(s);
      auto rp = CreateBaseline("ucx_raw_put", plain_mpi.get(), send, recv);
      if (!rp.ok()) return FailWith(rp.status());
      raw_put = std::move(*rp);
      auto pm = UcxPutMinFromEnvironment();
      if (!pm.ok()) return FailWith(pm.status());
      put_min = *pm;
    }
    std::vector<double> ours_ms, raw_ms, raw_ucx_ms, mpi_ms;
    ZeroCopyTally before;
    for (int it = -2; it < f.iters; ++it) {  // two warm-up rounds of each
      if (ucx && it == 0) before = ZeroCopyTally::Of(*t, round);
      auto o = round.Run();
      if (!o.ok()) return FailWith(o.status());
      double p = 0.0, m = 0.0;
      if (ucx) {
        auto rp = raw_put->RoundTripMs();
        if (!rp.ok()) return FailWith(rp.status());
        p = *rp;
      }
      auto a2a = (*baseline)->RoundTripMs();
      if (!a2a.ok()) return FailWith(a2a.status());
      const double r = *a2a;
      if (ucx) {
        auto mr = mpi_round->Run();
        if (!mr.ok()) return FailWith(mr.status());
        m = *mr;
      }
      if (it >= 0) {
        ours_ms.push_back(*o);
        raw_ms.push_back(r);
        raw_ucx_ms.push_back(p);
        mpi_ms.push_back(m);
      }
    }
    // Zero-copy evidence: the ucx transport's counters over the timed rounds, every rank's
    // summed on rank 0 (sent after the window, so the gather itself is not counted).
    ZeroCopyTally total, router;
    if (ucx) {
      const ZeroCopyTally mine = ZeroCopyTally::Of(*t, round).Minus(before);
      const auto deadline = DeadlineIn(std::chrono::seconds(60));
      constexpr int kTagTally = 61;
      if (job.rank() == 0) {
        router = total = mine;
        for (int d = 1; d < n; ++d) {
          ZeroCopyTally other;
          if (Status s = t->Recv(d, kTagTally, &other, sizeof other, deadline); !s.ok()) {
            return FailWith(s);
          }
          total.Add(other);
        }
      } else if (Status s = t->Send(0, kTagTally, &mine, sizeof mine, deadline); !s.ok()) {
        return FailWith(s);
      }
    }
    const Result<double> ours = Median(ours_ms);
    const Result<double> raw = Median(raw_ms);
    if (job.rank() == 0) {
      report["ours_ms"] = *ours;
      report["alltoallv_ms"] = *raw;
      report["efficiency_vs_alltoallv"] = *raw / *ours;
      report["ours_gbps"] = 2.0 * static_cast<double>(sum) / (*ours * 1e6);
      if (!ucx) {
        std::fprintf(stderr,
                     "transport %s %d ranks: %lld tokens, %.2f MiB per peer: dispatch+combine "
                     "%.3f ms (%.2f GB/s), MPI_Alltoallv %.3f ms -> efficiency_vs_alltoallv "
                     "%.2f\n",
                     job.transport().c_str(), n, static_cast<long long>(tokens),
                     static_cast<double>(sum) / (n - 1) / (1 << 20), *ours,
                     report["ours_gbps"].get<double>(), *raw, *raw / *ours);
      } else {
        const double raw_ucx = Median(raw_ucx_ms), mpi_t = Median(mpi_ms);
        report["ours_ms_min"] = *std::min_element(ours_ms.begin(), ours_ms.end());
        report["raw_ucx_ms"] = raw_ucx;
        report["raw_ucx_ms_min"] = *std::min_element(raw_ucx_ms.begin(), raw_ucx_ms.end());
        report["efficiency_vs_raw_ucx"] = raw_ucx / *ours;
        report["mpi_transport_ms"] = mpi_t;
        report["speedup_vs_mpi_transport"] = mpi_t / *ours;
        report["ucx_put_min"] = put_min;
        const char* tls = std::getenv("UCX_TLS");
        report["ucx_tls"] = tls != nullptr ? tls : "";
        const double copies =
            total.payload_bytes > 0
                ? static_cast<double>(total.copied_bytes + total.payload_eager_bytes) /
                      static_cast<double>(total.payload_bytes)
                : 0.0;
        json zc = total.ToJson();
        zc["transport_copies_per_payload_byte"] = copies;
        zc["timed_rounds"] = f.iters;
        zc["router"] = router.ToJson();
        zc["note"] =
            "Counter deltas of the ucx transport over the timed rounds of our dispatch + "
            "combine, summed over all ranks (router: rank 0 alone). put_bytes were written by "
            "ucp_put_nbx straight into the peer's registered buffer (UCX does that by RDMA or "
            "single-copy shared memory where it can, else emulates the put with copies through "
            "its shared-memory FIFO or TCP: UCX_PROTO_ENABLE=y UCX_PROTO_INFO=y shows which); "
            "eager_bytes went through "
            "UCX's bounce buffers (headers, barrier notes, and any row message under "
            "ucx_put_min: payload_eager_bytes); copied_bytes are memcpys by the transport. "
            "payload_bytes are the row bytes moved in both directions. "
            "transport_copies_per_payload_byte = (copied_bytes + payload_eager_bytes) / "
            "payload_bytes. Not in these figures: in serving, the router's gather of each "
            "token's row into the registered send buffer is the single copy of each row (made "
            "by the EP layer, not the transport); this microbenchmark sends a prepared buffer, "
            "so it does not make that copy.";
        report["zero_copy"] = zc;
        std::fprintf(stderr,
                     "transport ucx %d ranks: %lld tokens, %.2f MiB per peer: dispatch+combine "
                     "%.3f ms (%.2f GB/s), raw ucp_put %.3f ms -> efficiency_vs_raw_ucx %.2f, "
                     "our protocol over mpi %.3f ms -> speedup_vs_mpi_transport %.2f, "
                     "MPI_Alltoallv %.3f ms -> efficiency_vs_alltoallv %.2f; transport copies "
                     "per payload byte %.3f\n",
                     n, static_cast<long long>(tokens),
                     static_cast<double>(sum) / (n - 1) / (1 << 20), *ours,
                     report["ours_gbps"].get<double>(), raw_ucx, raw_ucx / *ours, mpi_t,
                     mpi_t / *ours, *raw, *raw / *ours, copies);
      }
    }
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
