// `moerun serve` on a router rank: runtime/service's RouterService (the serving endpoint, its
// batcher, the loop and the request path down to the router rank) with what the launcher adds:
// on router 0 the moectl control endpoint and the placement control, and the rank's metrics,
// refreshed by the service's tick between batches and when idle.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/metrics.h"
#include "base/status.h"
#include "launch/rank_services.h"
#include "launch/serve_config.h"
#include "runtime/migration/router_control.h"
#include "runtime/ranks/router_rank.h"
#include "runtime/serving/host_port.h"

namespace moerun {

// What every rank of a serve job knows once the config and flags are read.
struct ServeSetup {
  ServeConfig config;
  HostPort listen, control_listen, metrics_listen;
  std::string token;                      // the control token; empty: no control endpoint
  std::string serving_key;                // every InferRequest must carry it; empty: none
  std::shared_ptr<TlsServerContext> tls;  // TLS on the serving and control endpoints; null: none
  std::string ready_file;                 // written once router 0 listens
  std::vector<int> layers;
  int64_t hidden = 0;
  std::string family;
  int ranks = 0;
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
};

// Router 0's metrics of the expert weight updates (moectl expert update / promote / rollback):
//   moerun_expert_updates_total{result="promoted|rolled_back|failed"}  updates that ended so
//       (registered at 0, so the series exist before the first update)
//   moerun_expert_update_canary_share{layer,expert}  the share of the expert's rows the new
//       weights compute while the update is in canary (0 once promoted, rolled back or failed)
//   moerun_expert_update_rows{layer,expert}, moerun_expert_update_canary_rows{layer,expert}:
//       rows the expert's ranks computed since its last update began, and those of them the new
//       weights computed (router 0 asks the ranks once a second while in canary)
// The per-expert series appear with the expert's first update. Not thread-safe: one thread
// (router 0's serving loop) calls Refresh.
class ExpertUpdateMetrics {
 public:
  explicit ExpertUpdateMetrics(MetricsRegistry* metrics);
  void Refresh(const std::vector<ExpertUpdateView>& updates, const ExpertUpdateResults& results);

 private:
  struct PerExpert {
    Gauge* share = nullptr;
    Gauge* rows = nullptr;
    Gauge* canary_rows = nullptr;
  };
  MetricsRegistry* metrics_;
  Counter* promoted_;
  Counter* rolled_back_;
  Counter* failed_;
  ExpertUpdateResults counted_;
  std::map<std::pair<int, int>, PerExpert> experts_;
};

// Serves until `stop` is set (SIGTERM) and the requests in flight are answered (or the drain
// timeout passes); sets `stop` itself when the control channel fails, so that the other ranks of
// this process stop too. `router` must be ready; the caller finishes it afterwards.
Status ServeRouter(RouterRank& router, RankServices& services, const ServeSetup& setup,
                   std::atomic<bool>& stop);

}  // namespace moerun
