#include "launch/moebench/serve_bench.h"
#include "launch/moebench/serve_floor.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/dtype.h"
#include "base/exit_code.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "base/trace_context.h"
#include "launch/plot/svg_plot.h"
#include "runtime/layer/moe_layer.h"
#include "runtime/serving/control_auth.h"
#include "runtime/serving/failover_client.h"
#include "runtime/serving/frame.h"
#include "runtime/serving/serve_client.h"

namespace moerun::bench {
namespace {

using json = nlohmann::json;
using Clock = SteadyClock;
using std::chrono::milliseconds;

constexpr size_t kMaxInFlightPerConnection = 1024;
constexpr auto kReconnectPause = milliseconds(100);
constexpr auto kReceivePoll = milliseconds(100);

// What every connection sends: P request bodies without their id (a Protobuf message is the
// concatenation of its fields, so "id field + body" is the whole request), and with --verify the
// exact answer data expected for each.
struct Workload {
  std::vector<std::string> targets;  // one router, or several to fail over between
  int64_t tokens = 0;
  int64_t hidden = 0;
  v1::DType dtype = v1::F32;
  size_t elem_bytes = 4;
  std::vector<std::string> bodies;
  std::vector<std::string> expected;  // empty unless verifying
  std::string key;                    // the serving key sent in every request (--key-file)
  // --floor: the inputs as the server sees them, and the layer in process.
  std::vector<std::vector<float>> inputs;
  std::unique_ptr<ThreadPool> pool, single_pool;
  std::unique_ptr<MoeLayer> layer, layer_single;
  milliseconds wait{60000};  // how long a client waits for one answer
  // --trace-share: the share of requests sent with a sampled traceparent; --trace-log: each
  // traced request's "traceparent round_trip_us code" (closed loop), one line each.
  double trace_share = 0;
  std::FILE* trace_log = nullptr;
  std::shared_ptr<std::mutex> trace_mu = std::make_shared<std::mutex>();
};

// The InferRequest.traceparent field (10) of a new sampled trace, or "" (its text in *text).
std::string MaybeTraceField(const Workload& w, std::mt19937_64& rng, std::string* text) {
  text->clear();
  if (w.trace_share <= 0 || std::uniform_real_distribution<double>(0, 1)(rng) >= w.trace_share) {
    return {};
  }
  TraceContext ctx;
  ctx.trace_id = NewTraceId();
  ctx.parent_id = NewSpanId();
  ctx.flags = 1;
  *text = FormatTraceparent(ctx);
  std::string f;
  f.push_back(static_cast<char>(10 << 3 | 2));
  f.push_back(static_cast<char>(text->size()));  // 55 < 128: one length byte
  return f + *text;
}

// "" when the answer is right; else the error kind, with the reason in *why.
std::string CheckAnswer(const Workload& w, const v1::InferResponse& r, int input,
                        std::string* why) {
  if (r.code() != v1::OK) {
    *why = r.message();
    return ErrorCodeKind(r.code());
  }
  const size_t bytes = static_cast<size_t>(w.tokens * w.hidden) * w.elem_bytes;
  if (r.dtype() != w.dtype || r.shape_size() != 2 || r.shape(0) != w.tokens ||
      r.shape(1) != w.hidden || r.data().size() != bytes) {
    *why = "answer " + std::to_string(r.id()) + " has dtype " + std::to_string(r.dtype()) + ", " +
           std::to_string(r.shape_size()) + " dims and " + std::to_string(r.data().size()) +
           " bytes; expected [" + std::to_string(w.tokens) + ", " + std::to_string(w.hidden) +
           "] of " + (w.elem_bytes == 4 ? "F32" : "BF16");
    return "mismatch";
  }
  if (!w.expected.empty() && r.data() != w.expected[static_cast<size_t>(input)]) {
    *why =
        "answer " + std::to_string(r.id()) + " (input " + std::to_string(input) +
        ") differs from the local layer at " +
        FirstDifference(r.data(), w.expected[static_cast<size_t>(input)], w.elem_bytes, w.hidden);
    return "mismatch";
  }
  return "";
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// One thread's counts; merged at the end.
struct Stats {
  AnswerCounts counts;
  std::vector<double> latency_ms;
  // How long each failed request took to fail (from when it was due to when its failure was
  // known): a bound on a deadline must hold for the answers that failed, too.
  std::vector<double> failed_latency_ms;
  std::vector<std::pair<Clock::time_point, double>> ok_at;  // completion, latency ms
  std::vector<Clock::time_point> error_at;
  Clock::time_point last_done{};  // of a measured request
  int64_t failovers = 0;          // moves to another router (closed loop, several targets)
  int64_t retried = 0;            // requests sent again after their router's connection broke

  // A failed request, due at `since` (its latency is from then to now).
  void Error(bool measured, const std::string& kind, const std::string& why,
             Clock::time_point since) {
    counts.Failed(measured, kind, why);
    if (!measured) return;
    const auto now = Clock::now();
    error_at.push_back(now);
    failed_latency_ms.push_back(Ms(now - since));
  }
  void Ok(bool measured, bool verified_answer, double ms, Clock::time_point done) {
    counts.Answered(measured, verified_answer);
    if (!measured) return;
    latency_ms.push_back(ms);
    ok_at.emplace_back(done, ms);
    last_done = std::max(last_done, done);
  }
  void Merge(const Stats& o) {
    failovers += o.failovers;
    retried += o.retried;
    counts.Merge(o.counts);
    latency_ms.insert(latency_ms.end(), o.latency_ms.begin(), o.latency_ms.end());
    failed_latency_ms.insert(failed_latency_ms.end(), o.failed_latency_ms.begin(),
                             o.failed_latency_ms.end());
    ok_at.insert(ok_at.end(), o.ok_at.begin(), o.ok_at.end());
    error_at.insert(error_at.end(), o.error_at.begin(), o.error_at.end());
    last_done = std::max(last_done, o.last_done);
  }
};

struct Schedule {
  Clock::time_point start;    // first send
  Clock::time_point measure;  // start + warmup
  Clock::time_point end;      // measure + duration: no send at or after it
};

uint64_t RequestId(int conn, uint64_t seq) { return (static_cast<uint64_t>(conn + 1) << 40) | seq; }
int InputOf(const Workload& w, int conn, uint64_t seq) {
  return static_cast<int>((seq + static_cast<uint64_t>(conn) * 7919u) % w.bodies.size());
}

// Closed loop: one request in flight; a broken connection is replaced (each failed attempt
// counts as a request with a "connect" error). With several targets a request whose router's
// connection broke is sent once more to the next router.
void ClosedLoop(const Workload& w, const Schedule& s, int c, FailoverClient* client, Stats* st) {
  v1::InferResponse resp;
  std::mt19937_64 rng(static_cast<uint64_t>(c) + 1);
  std::string traceparent;
  for (uint64_t seq = 0;; ++seq) {
    const auto t0 = Clock::now();
    if (t0 >= s.end) break;
    const bool measured = t0 >= s.measure;
    if (!client->connected()) {
      const Status cs = client->Connect();
      if (!cs.ok()) {
        st->Error(measured, "connect", cs.message(), t0);
        std::this_thread::sleep_for(kReconnectPause);
        continue;
      }
    }
    const uint64_t id = RequestId(c, seq);
    const int input = InputOf(w, c, seq);
    const Deadline deadline = t0 + w.wait;
    const std::string& body = w.bodies[static_cast<size_t>(input)];
    const std::string trace = MaybeTraceField(w, rng, &traceparent);
    const Status status =
        client->Call([&](ServeConnection* conn,
                         Deadline d) { return SendRequestFrame(conn, id, body, trace, d); },
                     id, &resp, deadline);
    st->failovers = static_cast<int64_t>(client->failovers());
    st->retried = static_cast<int64_t>(client->retried());
    if (!status.ok()) {
      st->Error(measured, status.code() == StatusCode::kDeadlineExceeded ? "client_timeout" : "io",
                status.message(), t0);
      client->Drop();  // a late answer must not be taken for the next request's
      continue;
    }
    const auto done = Clock::now();
    std::string why;
    const std::string kind = CheckAnswer(w, resp, input, &why);
    if (kind.empty()) {
      st->Ok(measured, !w.expected.empty(), Ms(done - t0), done);
    } else {
      st->Error(measured, kind, why, t0);
    }
    if (!traceparent.empty() && w.trace_log != nullptr) {
      std::lock_guard<std::mutex> lock(*w.trace_mu);
      std::fprintf(w.trace_log, "%s %lld %d\n", traceparent.c_str(),
                   static_cast<long long>(
                       std::chrono::duration_cast<std::chrono::microseconds>(done - t0).count()),
                   static_cast<int>(resp.code()));
    }
  }
}

// Open loop: a sender on a fixed schedule and a receiver, sharing the in-flight table.
class OpenLoopConnection {
 public:
  OpenLoopConnection(const Workload& w, const Schedule& s, int c, double interval_s,
                     double offset_s, std::unique_ptr<ServeConnection> conn)
      : w_(w),
        s_(s),
        c_(c),
        interval_s_(interval_s),
        offset_s_(offset_s),
        give_up_(s.end + w.wait),
        conn_(std::move(conn)) {}

  void Run(Stats* stats) {
    Stats recv_stats;
    std::thread receiver([&] { Receive(&recv_stats); });
    Send(stats);
    receiver.join();
    // Whatever the receiver gave up on, or the sender added after it did.
    FailAllInFlight(
        &recv_stats, "client_timeout",
        "no answer within " + std::to_string(w_.wait.count()) + " ms of the end of the run");
    stats->Merge(recv_stats);
  }

 private:
  struct Pending {
    Clock::time_point scheduled;
    int input;
    bool measured;
  };

  Clock::time_point Scheduled(uint64_t k) const {
    const double t = offset_s_ + static_cast<double>(k) * interval_s_;
    return s_.start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(t));
  }

  void Send(Stats* st) {
    for (uint64_t seq = 0;; ++seq) {
      const auto at = Scheduled(seq);
      if (at >= s_.end) break;
      std::this_thread::sleep_until(at);
      const bool measured = at >= s_.measure;
      if (broken_.load()) {
        st->Error(measured, "io", "connection lost: " + BrokenWhy(), at);
        continue;
      }
      const uint64_t id = RequestId(c_, seq);
      const int input = InputOf(w_, c_, seq);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (in_flight_.size() >= kMaxInFlightPerConnection) {
          st->Error(measured, "client_backlog",
                    std::to_string(kMaxInFlightPerConnection) + " requests in flight", at);
          continue;
        }
        in_flight_[id] = Pending{at, input, measured};
      }
      // A send blocks while the server does not read (TCP flow control); never past the end.
      const std::string trace = MaybeTraceField(w_, rng_, &traceparent_);
      const Status status = SendRequestFrame(conn_.get(), id, w_.bodies[static_cast<size_t>(input)],
                                             trace, std::min(Clock::now() + w_.wait, give_up_));
      if (!status.ok()) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          in_flight_.erase(id);
          if (!broken_.load()) broken_why_ = status.message();
        }
        st->Error(measured,
                  status.code() == StatusCode::kDeadlineExceeded ? "client_timeout" : "io",
                  status.message(), at);
        broken_ = true;
        conn_->Shutdown();  // wakes the receiver
      }
    }
    sender_done_ = true;
  }

  std::string BrokenWhy() {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_why_;
  }

  void FailAllInFlight(Stats* st, const std::string& kind, const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, p] : in_flight_) st->Error(p.measured, kind, why, p.scheduled);
    in_flight_.clear();
  }

  void Receive(Stats* st) {
    const Clock::time_point give_up = give_up_;
    v1::InferResponse resp;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (sender_done_.load() && in_flight_.empty()) return;
      }
      if (Clock::now() >= give_up) return;  // Run fails what is left in flight
      if (broken_.load()) {
        FailAllInFlight(st, "io", "connection lost: " + BrokenWhy());
        if (sender_done_.load()) return;
        std::this_thread::sleep_for(milliseconds(10));
        continue;
      }
      const Status status = conn_->Receive(&resp, std::min(give_up, Clock::now() + kReceivePoll));
      if (status.code() == StatusCode::kDeadlineExceeded) continue;
      if (!status.ok()) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (!broken_.load()) broken_why_ = status.message();
        }
        broken_ = true;
        continue;
      }
      const auto done = Clock::now();
      std::optional<Pending> p;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = in_flight_.find(resp.id());
        if (it != in_flight_.end()) {
          p = it->second;
          in_flight_.erase(it);
        }
      }
      if (!p) {
        st->Error(done >= s_.measure, "io",
                  "answer for id " + std::to_string(resp.id()) + ", which is not in flight", done);
        continue;
      }
      std::string why;
      const std::string kind = CheckAnswer(w_, resp, p->input, &why);
      if (kind.empty()) {
        st->Ok(p->measured, !w_.expected.empty(), Ms(done - p->scheduled), done);
      } else {
        st->Error(p->measured, kind, why, p->scheduled);
      }
    }
  }

  const Workload& w_;
  const Schedule& s_;
  const int c_;
  const double interval_s_;
  const double offset_s_;
  const Clock::time_point give_up_;  // no send or receive after it
  std::unique_ptr<ServeConnection> conn_;
  std::mt19937_64 rng_{static_cast<uint64_t>(c_) + 1};  // --trace-share (the sender's)
  std::string traceparent_;
  std::mutex mu_;
  std::unordered_map<uint64_t, Pending> in_flight_;  // guarded by mu_
  std::string broken_why_;                           // guarded by mu_ (written once)
  std::atomic<bool> broken_{false};
  std::atomic<bool> sender_done_{false};
};

}  // namespace

Status Validate(const ServeBenchFlags& f) {
  const auto bad = [](const std::string& m) { return Status::InvalidArgument(m); };
  MOERUN_RETURN_IF_ERROR(ValidateClientFlags(f.client));
  MOERUN_ASSIGN_OR_RETURN(const std::vector<std::string> targets, ParseTargets(f.client.target));
  if (targets.size() > 1 && f.rate > 0) {
    return bad("several --target routers (failover) need the closed loop: drop --rate");
  }
  if (f.concurrency < 1 || f.concurrency > 1024) return bad("--concurrency must be in 1..1024");
  if (f.floor && (!f.verify || f.concurrency != 1 || f.rate > 0 || targets.size() > 1)) {
    return bad(
        "--floor measures a lone request's floor: it needs --verify (the layer in process), "
        "--concurrency 1, the closed loop (no --rate) and one --target");
  }
  if (!std::isfinite(f.duration_s) || f.duration_s <= 0 || f.duration_s > 86400) {
    return bad("--duration must be in (0, 86400] seconds");
  }
  if (!std::isfinite(f.warmup_s) || f.warmup_s < 0 || f.warmup_s > 3600) {
    return bad("--warmup must be in 0..3600 seconds");
  }
  if (f.tokens_per_request < 1 || f.tokens_per_request > (1 << 20)) {
    return bad("--tokens-per-request must be in 1..1048576");
  }
  if (!std::isfinite(f.rate) || f.rate < 0 || f.rate > 1e7) {
    return bad("--rate must be in 0..1e7 requests/s (0: closed loop)");
  }
  if (f.dtype != "f32" && f.dtype != "bf16") {
    return bad("--dtype must be f32 or bf16, not '" + f.dtype + "'");
  }
  if (f.deadline_ms < 0 || f.deadline_ms > 86400000) {
    return bad("--deadline-ms must be in 0..86400000 (0: the server's default)");
  }
  if (f.inputs < 1 || f.inputs > 65536) return bad("--inputs must be in 1..65536");
  if (f.hidden < 0 || f.hidden > (1 << 20)) return bad("--hidden must be in 1..1048576");
  if (!f.verify) {
    if (f.hidden == 0) return bad("--hidden H is required without --verify");
    if (!f.layer.model.empty() || !f.layer.preset.empty()) {
      return bad("--model and --preset are for --verify");
    }
  } else if (f.layer.model.empty() == f.layer.preset.empty()) {
    return bad("--verify needs exactly one of --model DIR and --preset NAME");
  }
  return ValidateLayerFlags(f.layer);
}

namespace {

// The request bodies, and with --verify the local layer's answers (hidden from the layer).
Status BuildWorkload(const ServeBenchFlags& f, Workload* w) {
  std::optional<int> request_layer;
  if (f.layer.layer >= 0) request_layer = f.layer.layer;
  std::shared_ptr<const MoeLayerWeights> weights;
  std::unique_ptr<ThreadPool> pool;
  const CpuKernels* kernels = nullptr;
  if (f.verify) {
    MOERUN_ASSIGN_OR_RETURN(const Isa isa, ChooseIsa(f.layer.isa));
    kernels = &KernelsFor(isa);
    pool = std::make_unique<ThreadPool>(f.layer.threads);
    MOERUN_ASSIGN_OR_RETURN(weights, LoadLayerFromFlags(f.layer, *kernels, pool->size()));
    if (f.hidden != 0 && f.hidden != weights->spec.hidden) {
      return Status::InvalidArgument("--hidden " + std::to_string(f.hidden) +
                                     " but the layer's is " + std::to_string(weights->spec.hidden));
    }
    w->hidden = weights->spec.hidden;
    request_layer = weights->layer;  // the layer checked against, named explicitly
    spdlog::info("verifying against {}", DescribeLayer(*weights));
  } else {
    w->hidden = f.hidden;
  }
  w->tokens = f.tokens_per_request;
  w->dtype = f.dtype == "bf16" ? v1::BF16 : v1::F32;
  w->elem_bytes = w->dtype == v1::BF16 ? 2 : 4;
  const int64_t count = w->tokens * w->hidden;
  const double total = static_cast<double>(count) * static_cast<double>(w->elem_bytes) *
                       static_cast<double>(f.inputs) * (f.verify ? 2 : 1);
  if (total > 8e9) {
    return Status::InvalidArgument("--inputs " + std::to_string(f.inputs) + " of " +
                                   std::to_string(w->tokens) + " x " + std::to_string(w->hidden) +
                                   " values need over 8 GB: use fewer --inputs");
  }
  if (static_cast<double>(count) * static_cast<double>(w->elem_bytes) + 64 >
      static_cast<double>(kDefaultMaxFrameBytes)) {
    spdlog::warn("requests of {} bytes are over the server's default frame limit of {} bytes",
                 count * static_cast<int64_t>(w->elem_bytes), kDefaultMaxFrameBytes);
  }
  w->wait = f.deadline_ms > 0 ? milliseconds(f.deadline_ms + 5000) : milliseconds(60000);

  std::unique_ptr<MoeLayer> layer;
  if (weights) layer = std::make_unique<MoeLayer>(weights, *kernels, pool.get());
  std::vector<float> out(static_cast<size_t>(count));
  v1::InferRequest req;
  for (int p = 0; p < f.inputs; ++p) {
    std::vector<float> x = MakeInput(f.seed_inputs, p, count);
    req.Clear();
    if (!w->key.empty()) req.set_key(w->key);
    if (request_layer) req.set_layer(*request_layer);
    if (f.deadline_ms > 0) req.set_deadline_ms(static_cast<uint32_t>(f.deadline_ms));
    SetRequestData(&req, x.data(), w->tokens, w->hidden, w->dtype);
    w->bodies.push_back(req.SerializeAsString());
    if (!layer) continue;
    if (w->dtype == v1::BF16) {  // what the server sees: the input rounded to bf16, widened
      for (float& v : x) v = Bf16ToF32(F32ToBf16(v));
    }
    MOERUN_RETURN_IF_ERROR(layer->Forward(x.data(), w->tokens, out.data()));
    v1::InferRequest expect;  // the answer's data, rounded as the server rounds it
    SetRequestData(&expect, out.data(), w->tokens, w->hidden, w->dtype);
    w->expected.push_back(std::move(*expect.mutable_data()));
    if (f.floor) w->inputs.push_back(std::move(x));
  }
  if (f.floor) {
    w->pool = std::move(pool);
    w->layer = std::move(layer);
    if (w->pool->size() > 1) {
      w->single_pool = std::make_unique<ThreadPool>(1);
      w->layer_single = std::make_unique<MoeLayer>(weights, *kernels, w->single_pool.get());
    }
  }
  return Status::Ok();
}

}  // namespace

// --plot: the per-second timeline (second i: what completed in [i, i+1) s of the measured run,
// drawn at its middle, i + 0.5): latency above, answers and errors per second below.
std::string TimelineSvg(const ServeBenchFlags& f, const Workload& w, const json& timeline,
                        double rps, double tps) {
  plot::LineChart lat{"Latency of the answers completed in each second",
                      "time into the run (s)",
                      "latency (ms)",
                      {{"p50", {}, {}}, {"p99", {}, {}}, {"max", {}, {}, true}}};
  plot::LineChart thr{
      fmt::format("Throughput: {:.1f} requests/s, {:.0f} tokens/s over the run", rps, tps),
      "time into the run (s)",
      "per second",
      {{"answers", {}, {}}, {"errors", {}, {}}}};
  for (const json& p : timeline) {
    const double x = p["t_s"].get<double>() + 0.5;
    const bool any = p["ok"].get<int64_t>() > 0;
    const double none = std::numeric_limits<double>::quiet_NaN();  // no answer: no point
    const char* keys[] = {"p50_ms", "p99_ms", "max_ms"};
    for (size_t k = 0; k < 3; ++k) {
      lat.series[k].x.push_back(x);
      lat.series[k].y.push_back(any ? p[keys[k]].get<double>() : none);
    }
    thr.series[0].x.push_back(x);
    thr.series[0].y.push_back(p["ok"].get<double>());
    thr.series[1].x.push_back(x);
    thr.series[1].y.push_back(p["errors"].get<double>());
  }
  plot::LineFigure fig;
  fig.title = fmt::format(
      "moebench serve {}: {} x{}, {} tokens/request, {}", f.client.target,
      f.rate > 0 ? fmt::format("open loop {:g} req/s", f.rate) : std::string("closed loop"),
      f.concurrency, w.tokens, f.dtype);
  fig.charts = {lat, thr};
  return plot::LineFigureSvg(fig);
}

int RunServeBench(const ServeBenchFlags& f) {
  if (Status s = Validate(f); !s.ok()) return FailWith(s);
  if (!f.plot.empty()) {
    if (Status s = plot::CheckSvgPath("--plot", f.plot); !s.ok()) return FailWith(s);
  }
  Workload w;
  w.targets = *ParseTargets(f.client.target);  // checked by Validate
  // Fail fast on an unreachable target, before loading a layer.
  if (Status s = ProbeTargets(f.client); !s.ok()) return FailWith(s);
  Result<std::string> key = ReadServingKey(f.client);
  if (!key.ok()) return FailWith(key.status());
  w.key = std::move(*key);
  w.trace_share = f.trace_share;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> trace_log(nullptr, &std::fclose);
  if (!f.trace_log.empty()) {
    trace_log.reset(std::fopen(f.trace_log.c_str(), "w"));
    if (!trace_log) {
      return FailWith(Status::InvalidArgument("--trace-log " + f.trace_log +
                                              ": cannot write: " + std::strerror(errno)));
    }
    w.trace_log = trace_log.get();
  }
  if (Status s = BuildWorkload(f, &w); !s.ok()) return FailWith(s);

  // Connection c starts at router c % targets (several: the load is spread over them).
  std::vector<std::unique_ptr<FailoverClient>> clients;
  for (int c = 0; c < f.concurrency; ++c) {
    clients.push_back(std::make_unique<FailoverClient>(w.targets, static_cast<size_t>(c),
                                                       FailoverOptionsFor(f.client)));
    if (Status st = clients.back()->Connect(); !st.ok()) return FailWith(st);
  }
  const bool open = f.rate > 0;
  spdlog::info(
      "serve {}: {} loop, {} connections, {} tokens x {} ({}) per request{}, {:.1f} s + "
      "{:.1f} s warmup",
      f.client.target, open ? "open" : "closed", f.concurrency, w.tokens, w.hidden, f.dtype,
      open ? fmt::format(", {:.1f} requests/s", f.rate) : std::string(), f.duration_s, f.warmup_s);

  Schedule s;
  s.start = Clock::now() + milliseconds(10);
  s.measure = s.start + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(f.warmup_s));
  s.end = s.measure +
          std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(f.duration_s));
  std::vector<Stats> stats(static_cast<size_t>(f.concurrency));
  std::vector<std::thread> threads;
  for (int c = 0; c < f.concurrency; ++c) {
    Stats* st = &stats[static_cast<size_t>(c)];
    FailoverClient* client = clients[static_cast<size_t>(c)].get();
    threads.emplace_back([&w, &s, &f, c, st, open, client]() {
      if (!open) {
        ClosedLoop(w, s, c, client, st);
        return;
      }
      const double interval = static_cast<double>(f.concurrency) / f.rate;
      OpenLoopConnection loop(w, s, c, interval, static_cast<double>(c) / f.rate,
                              client->TakeConnection());
      loop.Run(st);
    });
  }
  for (auto& t : threads) t.join();

  Stats all;
  for (const auto& st : stats) all.Merge(st);
  const double wall_s =
      std::chrono::duration<double>(std::max(all.last_done, s.end) - s.measure).count();
  const AnswerCounts& counts = all.counts;
  const int64_t error_count = counts.error_count();
  const json latency = LatencyJson(&all.latency_ms);
  // Per second of the measured run: answers, errors and latency of what completed in it (what a
  // fault's recovery looks like over time).
  json timeline = json::array();
  {
    const auto second = [&](Clock::time_point t) {
      return static_cast<int64_t>(std::chrono::duration<double>(t - s.measure).count());
    };
    std::map<int64_t, std::vector<double>> lat;
    std::map<int64_t, int64_t> errs;
    for (const auto& [t, ms] : all.ok_at) lat[second(t)].push_back(ms);
    for (const auto& t : all.error_at) ++errs[second(t)];
    const int64_t last =
        std::max(lat.empty() ? 0 : lat.rbegin()->first, errs.empty() ? 0 : errs.rbegin()->first);
    for (int64_t i = 0; i <= last; ++i) {
      std::vector<double>& v = lat[i];
      std::sort(v.begin(), v.end());
      timeline.push_back({{"t_s", i},
                          {"ok", v.size()},
                          {"errors", errs[i]},
                          {"p50_ms", Percentile(v, 0.50)},
                          {"p99_ms", Percentile(v, 0.99)},
                          {"max_ms", v.empty() ? 0.0 : v.back()}});
    }
  }
  const double measure_unix_s =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count() -
      std::chrono::duration<double>(Clock::now() - s.measure).count();
  const double rps = static_cast<double>(counts.ok) / wall_s;
  const double tps = static_cast<double>(counts.ok * w.tokens) / wall_s;

  json report;
  report["bench"] = "serve";
  report["target"] = f.client.target;
  report["mode"] = open ? "open" : "closed";
  report["rate"] = open ? json(f.rate) : json(nullptr);
  report["concurrency"] = f.concurrency;
  report["tokens_per_request"] = w.tokens;
  report["hidden"] = w.hidden;
  report["dtype"] = f.dtype;
  report["deadline_ms"] = f.deadline_ms;
  report["inputs"] = f.inputs;
  report["duration_s"] = f.duration_s;
  report["warmup_s"] = f.warmup_s;
  report["wall_s"] = wall_s;
  report.update(AnswerCountsJson(counts));
  report["requests_per_s"] = rps;
  report["tokens_per_s"] = tps;
  report["latency_ms"] = latency;
  // (the requests that failed: from when each was due to when its failure was known)
  report["failed_latency_ms"] = LatencyJson(&all.failed_latency_ms);
  report["verify"] = f.verify;
  report["targets"] = w.targets;
  report["failovers"] = all.failovers;
  report["retried"] = all.retried;
  report["measure_start_unix_s"] = measure_unix_s;
  report["timeline"] = timeline;
  if (f.floor) {
    // The floor phase, on the first connection, once the run is over.
    FloorInputs fin;
    std::unique_ptr<ServeConnection> conn = clients.front()->TakeConnection();
    fin.connection = conn.get();
    fin.bodies = w.bodies;
    fin.inputs = w.inputs;
    fin.expected = w.expected;
    fin.tokens = w.tokens;
    fin.layer = w.layer.get();
    fin.layer_single = w.layer_single.get();
    fin.layer_threads = w.pool->size();
    fin.duration_s = f.duration_s;
    fin.wait = w.wait;
    Result<json> floor = conn ? MeasureFloor(fin) : Status::Unavailable("the connection broke");
    if (!floor.ok()) return FailWith(floor.status().WithContext("--floor"));
    report["floor"] = *floor;
    const json& fl = *floor;
    std::fprintf(stderr,
                 "floor (%lld rounds, p50 ms): client ping-pong %.3f + transport ping-pong %.3f "
                 "+ layer in process %.3f = %.3f | round trip p50 %.3f p99 %.3f: x_floor %.2f, "
                 "p99/p50 %.2f\n",
                 static_cast<long long>(fl["rounds"].get<int64_t>()),
                 fl["client_pingpong_ms"]["p50"].get<double>(),
                 fl["transport_pingpong_ms"]["p50"].get<double>(),
                 fl["layer_p50_used_ms"].get<double>(), fl["floor_ms"].get<double>(),
                 fl["round_trip_ms"]["p50"].get<double>(), fl["round_trip_ms"]["p99"].get<double>(),
                 fl["x_floor"].get<double>(), fl["p99_over_p50"].get<double>());
  }
  if (f.json) std::printf("%s\n", report.dump(2).c_str());

  std::fprintf(
      stderr,
      "serve %s %s loop x%d, T=%lld %s: %lld requests, %lld ok, %lld errors | "
      "%.1f req/s, %.0f tok/s | latency ms p50 %.3f p90 %.3f p99 %.3f max %.3f "
      "mean %.3f%s\n",
      f.client.target.c_str(), open ? "open" : "closed", f.concurrency,
      static_cast<long long>(w.tokens), f.dtype.c_str(), static_cast<long long>(counts.requests),
      static_cast<long long>(counts.ok), static_cast<long long>(error_count), rps, tps,
      latency["p50"].get<double>(), latency["p90"].get<double>(), latency["p99"].get<double>(),
      latency["max"].get<double>(), latency["mean"].get<double>(),
      f.verify ? fmt::format(" | verified {}/{} bitwise", counts.verified, counts.ok).c_str() : "");
  int rc = 0;
  if (!f.plot.empty()) {
    if (Status ps = plot::WriteSvg(f.plot, TimelineSvg(f, w, timeline, rps, tps)); !ps.ok()) {
      rc = FailWith(ps);
    } else {
      std::fprintf(stderr, "serve: plot written to %s\n", f.plot.c_str());
    }
  }
  bool no_request = false;
  if (counts.requests == 0) {
    std::fprintf(stderr, "serve: no request was measured (duration too short?)\n");
    no_request = true;
  }
  const int code = ExitCodeOfAnswers("serve", counts, f.verify, no_request);
  return code == 0 || (code == kExitAnswersDiffer && rc != 0) ? rc : code;
}

}  // namespace moerun::bench
