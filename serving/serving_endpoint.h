// The serving endpoint of a router rank: InferRequest frames from any number of connections,
// checked (serving/infer_codec.h), fed to the router's Batcher, answered with InferResponse frames
// (by id, in any order). Several requests may be in flight per connection, up to
// max_inflight_per_connection (then the connection is not read until one is answered). Every
// request gets its answer or an error by its deadline: a timer answers DEADLINE_EXCEEDED if the
// batch has not come back by then. The batcher's bounded queue answers OVERLOADED when full.
//
// BeginDrain: no new connections; new requests get UNAVAILABLE; those in flight finish.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <unordered_map>
#include <unordered_set>

#include "base/metrics.h"
#include "serving/batcher.h"
#include "serving/framed_server.h"
#include "serving/infer_codec.h"

namespace moerun {

struct ServingOptions {
  FramedServerOptions framed;
  int max_inflight_per_connection = 64;
  std::chrono::milliseconds default_deadline{30000};
  std::chrono::milliseconds max_deadline{600000};
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

 private:
  ServingEndpoint() = default;
  void OnFrame(const std::shared_ptr<FramedConnection>& conn, std::string body, BudgetLease lease);
  void Answer(Pending& p, std::string frame, moerun::v1::ErrorCode code);
  void Release(Pending& p);
  static void OnBatchDone(void* ctx, const Status& status, const BatchInfo& info);

  ServingOptions opts_;
  ServedModel model_;
  Batcher* batcher_ = nullptr;
  std::unique_ptr<FramedServer> server_;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> in_flight_{0};
  std::unordered_map<uint64_t, int> per_conn_;  // requests in the batcher, by connection
  std::unordered_set<uint64_t> half_closed_;    // connections to close once per_conn_ is 0
  // Metrics.
  Counter* by_code_[10] = {};
  Counter* tokens_ = nullptr;
  Histogram* latency_ = nullptr;
  Gauge* in_flight_gauge_ = nullptr;
  Gauge* connections_ = nullptr;
};

}  // namespace moerun
