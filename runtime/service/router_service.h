// A router rank in service: the serving endpoint and its batcher in front of the RouterRank, and
// the loop between them. This is the request path of `moerun serve`, all of it inside runtime/:
//
//   runtime/serving/  frames in, checked, queued; the batcher forms a batch and calls ...
//   runtime/service/  RouterService::Forward (a batch whose experts are being re-placed waits
//                     here for them, within its deadline) -> ...
//   runtime/ranks/    RouterRank::Forward -> runtime/ep/RouterLayer -> router/, transport/
//                     and the expert ranks; the answer comes back the same way and the batcher
//                     writes each request's rows into its answer frame.
//
// Between batches and when idle the loop polls the router rank (health probes, control messages,
// migration steps; a failed control channel or router 0's drain order stops it) and calls the
// launcher's `tick` (its metrics, router 0's automatic placement). On stop it drains: router 0
// takes the other routers with it, new requests are refused, those in flight are answered or
// the drain timeout passes. One thread (the router rank's) calls everything but the endpoint's
// own I/O thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "base/metrics.h"
#include "base/status.h"
#include "runtime/ranks/router_rank.h"
#include "runtime/serving/batcher.h"
#include "runtime/serving/serving_endpoint.h"

namespace moerun {

struct RouterServiceOptions {
  ServingOptions serving;
  ServedModel model;
  BatcherOptions batching;
  std::chrono::seconds drain_timeout{30};
};

// What the launcher adds to the loop (each may be empty; all run on the loop's thread).
struct RouterServiceHooks {
  std::function<void()> tick;                             // between batches and when idle
  std::function<void(int64_t tokens, bool ok)> on_batch;  // after each batch
  std::function<void()> on_drain;                         // once, when the drain begins
};

class RouterService {
 public:
  // Listens (the endpoint's port is bound when this returns) and registers the batch counters
  // (moerun_batches_total, moerun_batch_tokens_total) in `metrics`.
  static Result<std::unique_ptr<RouterService>> Start(RouterRank& router,
                                                      RouterServiceOptions options,
                                                      MetricsRegistry* metrics);
  ~RouterService();

  // Serves until `stop` is set (or the control channel fails, or router 0 orders a drain: both
  // set it) and the drain is over. Returns the control channel's failure, if any.
  Status Run(std::atomic<bool>& stop, RouterServiceHooks hooks);

  BatcherStats stats() const { return batcher_.stats(); }
  bool draining() const { return draining_; }

 private:
  RouterService(RouterRank& router, RouterServiceOptions options);
  Status Forward(int layer, const float* x, int64_t tokens, float* out, Deadline deadline,
                 BatchStream* stream);
  // A transport probe (InferRequest.probe = PROBE_TRANSPORT): the rows to each live expert rank
  // and back (RouterRank::EchoRoundTrip); the stream learns each round trip.
  Status Probe(const float* x, int64_t tokens, float* out, Deadline deadline, BatchStream* stream);
  bool StopRequested();  // on stop: drain, then true
  void Poll();           // the router rank, then hooks_.tick

  RouterRank& router_;
  RouterServiceOptions opts_;
  Batcher batcher_;
  std::unique_ptr<ServingEndpoint> endpoint_;
  std::atomic<bool>* stop_ = nullptr;
  RouterServiceHooks hooks_;
  Status control_failed_;
  bool draining_ = false;
  std::chrono::steady_clock::time_point drain_until_{};
  std::vector<RankTiming> probe_ranks_;
  Counter* batches_ = nullptr;
  Counter* batch_tokens_ = nullptr;
};

}  // namespace moerun
