// `moerun serve` on a router rank: the serving endpoint (and, on router 0, the moectl control
// endpoint and the placement control) in front of the router rank, and the loop that feeds the
// router's batcher into it until a stop is asked for and the requests in flight have drained.
//
// The loop runs on the router rank's thread: each batch goes through RouterRank::Forward; between
// batches and when idle it polls the router rank (health probes, control messages, migration
// steps), ticks the automatic rebalancing and refreshes the rank's metrics.
#pragma once

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "base/status.h"
#include "launch/rank_services.h"
#include "launch/serve_config.h"
#include "ranks/router_rank.h"
#include "serving/host_port.h"

namespace moerun {

// What every rank of a serve job knows once the config and flags are read.
struct ServeSetup {
  ServeConfig config;
  HostPort listen, control_listen, metrics_listen;
  std::string token;       // the control token; empty: no control endpoint
  std::string ready_file;  // written once router 0 listens
  std::vector<int> layers;
  int64_t hidden = 0;
  std::string family;
  int ranks = 0;
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
};

// Serves until `stop` is set (SIGTERM) and the requests in flight are answered (or the drain
// timeout passes); sets `stop` itself when the control channel fails, so that the other ranks of
// this process stop too. `router` must be ready; the caller finishes it afterwards.
Status ServeRouter(RouterRank& router, RankServices& services, const ServeSetup& setup,
                   std::atomic<bool>& stop);

}  // namespace moerun
