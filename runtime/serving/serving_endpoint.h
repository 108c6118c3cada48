// The serving endpoint of a router rank: InferRequest frames from any number of connections,
// checked (runtime/serving/infer_codec.h), fed to the router's Batcher, answered with InferResponse
// frames (by id, in any order). Several requests may be in flight per connection, up to
// max_inflight_per_connection (then the connection is not read until one is answered). Every
// request gets its answer or an error by its deadline: a timer answers DEADLINE_EXCEEDED if the
// batch has not come back by then. The batcher's bounded queue answers OVERLOADED when full.
//
// The hidden states are copied once each way: the batcher decodes a request's data straight from
// the frame it arrived in into its batch, and encodes the output straight into the answer frame,
// after room for the frame header (written once the batch is done). Requests live in slots that
// are reused, frames in pooled buffers, and one timer serves every deadline, so that at steady
// state a request allocates nothing.
//
// Serving key: when options.key is set, a request whose InferRequest.key is missing or wrong is
// refused (UNAUTHENTICATED, with its id) before anything else is looked at; the refusals are
// logged as the control endpoint logs wrong tokens: one line for the first of a quiet period,
// then one summary per 10 s interval (runtime/serving/control_auth.h AuthFailureLog). With
// options.key_file the key file is looked at again (at most once a second, as requests come) and a
// changed one is taken: its key is required from then on, the old one still accepted for
// key_grace (runtime/serving/control_auth.h TokenFileWatch); a changed file that cannot be read, or
// that others may read, keeps the current key (logged).
//
// Probes (InferRequest.probe) measure the path's floor: PROBE_CLIENT is answered at once on the
// I/O thread with the request's own data (the client connection's round trip, same bytes);
// PROBE_TRANSPORT goes through the batcher as a batch of its own (kTransportProbeLayer), which
// the router answers with a ping-pong of its rows with each expert rank.
//
// Where a request's time went (queue, gate, dispatch, wait, combine, shared expert, each expert
// rank's round trip and compute, reply) goes into histograms in `metrics` for every request, and
// into its answer (InferResponse.timing) when the request asks (InferRequest.timing).
//
// BeginDrain: no new connections; new requests get UNAVAILABLE; those in flight finish.
// Threads: the framed server's I/O thread runs everything but OnBatchDone (the router thread),
// which hands finished requests back through a list and one wake-up of the I/O thread; the I/O
// thread writes the answer's frame around its data then (so that the reply's own time is known).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/metrics.h"
#include "runtime/serving/batcher.h"
#include "runtime/serving/framed_server.h"
#include "runtime/serving/infer_codec.h"
#include "runtime/serving/trace_exporter.h"

namespace moerun {

class TokenFileWatch;

struct ServingOptions {
  FramedServerOptions framed;
  int max_inflight_per_connection = 64;
  std::chrono::milliseconds default_deadline{30000};
  std::chrono::milliseconds max_deadline{600000};
  std::string key;                     // non-empty: every request must carry it (InferRequest.key)
  std::string key_file;                // where `key` was read: re-read when it changes ("": never)
  std::chrono::seconds key_grace{60};  // the old key accepted this long after a change
  TracingOptions tracing;              // OpenTelemetry traces (off without an endpoint)
};

class ServingEndpoint {
 public:
  // `batcher` and `metrics` must outlive the endpoint (or Stop).
  static Result<std::unique_ptr<ServingEndpoint>> Start(ServingOptions options, ServedModel model,
                                                        Batcher* batcher, MetricsRegistry* metrics);
  ~ServingEndpoint();

  uint16_t port() const;
  void BeginDrain();
  // Requests accepted and not yet answered by the batcher.
  int64_t in_flight() const { return in_flight_.load(); }
  void Stop();

  struct Pending;
  struct Timers;

 private:
  ServingEndpoint();
  void OnFrame(const std::shared_ptr<FramedConnection>& conn, PooledBuffer body, BudgetLease lease);
  void Refuse(FramedConnection& conn, uint64_t id, moerun::v1::ErrorCode code,
              const std::string& message);
  void Answer(Pending& p, moerun::v1::ErrorCode code, const std::string& message);
  void Release(Pending& p);
  Pending* TakeSlot();
  void FreeSlot(Pending* p);
  void Arm(Pending* p);          // the request's deadline joins the timer's heap
  void AnswerProbe(Pending* p);  // PROBE_CLIENT: answered at once with its own data
  void OnDeadlines();            // the timer fired: answer what is past its deadline
  void TakeFinished();           // I/O thread: the requests the router thread handed back
  void LogRefusedKey(FramedConnection& conn, bool missing);  // I/O thread
  void OnConnections(int n);                                 // I/O thread
  void ArmKeyLogTimer();
  static void OnBatchDone(void* ctx, const Status& status, const BatchInfo& info);

  ServingOptions opts_;
  ServedModel model_;
  Batcher* batcher_ = nullptr;
  std::unique_ptr<FramedServer> server_;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> in_flight_{0};
  // Request slots (I/O thread): every slot made so far, and the free ones.
  std::vector<std::unique_ptr<Pending>> slots_;
  std::vector<Pending*> free_;
  std::unique_ptr<Timers> timers_;
  std::unique_ptr<TokenFileWatch> key_watch_;  // with options.key_file (I/O thread)
  int conn_peak_ = 0;  // the most connections open since memory was last trimmed (I/O thread)
  // Requests the router thread has finished, waiting for the I/O thread (under done_mu_).
  std::mutex done_mu_;
  Pending* done_head_ = nullptr;
  bool wake_posted_ = false;
  // Metrics.
  Counter* by_code_[10] = {};
  Counter* tokens_ = nullptr;
  Histogram* latency_ = nullptr;
  // Where the requests' time went (moerun_request_part_seconds{part}), and by expert rank
  // (moerun_expert_round_trip_seconds{rank}, moerun_expert_compute_seconds{rank}).
  struct PartHistograms {
    Histogram *queue, *gate, *dispatch, *wait, *combine, *shared, *reply;
    std::vector<Histogram*> round_trip, compute;  // by rank - first_expert_rank
  };
  PartHistograms parts_{};
  void ObserveParts(const struct AnswerTiming& t);
  Gauge* in_flight_gauge_ = nullptr;
  Gauge* connections_ = nullptr;
  // Tracing (with options.tracing): the exporter, and why requests were kept.
  std::unique_ptr<TraceExporter> tracer_;
  void StartTrace(Pending& p);   // I/O thread, on a request's frame: its context, head sampling
  void FinishTrace(Pending& p);  // I/O thread, once answered: offers the trace if it is kept
  // A request refused before it reached the batcher: its trace (the root span) if kept.
  void TraceRefused(Pending& p, moerun::v1::ErrorCode code, const std::string& message);
  Counter* bad_traceparent_ = nullptr;
  Counter* traced_caller_ = nullptr;
  Counter* traced_share_ = nullptr;
  Counter* traced_slow_ = nullptr;
  Counter* traced_failed_ = nullptr;
};

}  // namespace moerun
