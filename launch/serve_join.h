// moerun serve --join HOST:PORT: a process started outside the job's mpirun takes over a dead
// expert rank of a running job. It makes its UCX worker, sends the worker's address to router 0's
// control endpoint (with the job's control token), waits while router 0 still re-places the dead
// rank's experts, and gets back the rank it now is and the routers' addresses; router 0 and every
// other router have by then replaced their endpoint for that rank. The caller then serves as
// that expert rank, holding no experts until a rebalance gives it some.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "runtime/serving/tls_client.h"
#include "transport/transport.h"

namespace moerun {

struct JoinTarget {
  std::string control;  // router 0's control endpoint HOST:PORT
  std::string token;    // the job's control token
  ClientTls tls;        // with the job's TLS: how to reach router 0's control endpoint
  // The joiner's job as its config gives it, checked by router 0 (experts, layers) and here
  // (the dispatch header size its placement spec makes).
  int num_experts = 0;
  std::vector<int> layers;
  std::string placement = "linear";
  int routers = 1;
  // How long to keep asking while router 0 is unreachable or the dead rank's experts are still
  // being re-placed.
  std::chrono::milliseconds timeout{600000};
};

struct Joined {
  std::unique_ptr<Transport> transport;  // rank(): the rank taken over
  uint64_t placement_version = 0;        // the version in use when it joined
};

Result<Joined> JoinJob(const JoinTarget& target);

}  // namespace moerun
