// What a router's control reports and takes (RouterControl and its parts): the views of a
// migration and of expert updates, a join's ask and grant, and a migration's options. Plain values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/status.h"

namespace moerun {

struct MigrationLayerView {
  int layer = 0;
  std::string state;  // pending | loading | switching | done | unchanged | failed
  int experts_to_load = 0, experts_to_free = 0;
  int64_t bytes_to_move = 0, bytes_loaded = 0;
  int64_t bytes_freed = 0;  // by the expert ranks once every router released the old copies
  double seconds = 0;
};

struct MigrationView {
  uint64_t id = 0;
  std::string state = "none";  // none | running | done | failed
  uint64_t from_version = 0, to_version = 0;
  std::vector<MigrationLayerView> layers;
  int64_t bytes_to_move = 0, bytes_loaded = 0, bytes_freed = 0;
  double elapsed_s = 0;
  std::string error, note, trigger;
  double throttle_bytes_s = 0;
};

struct ExpertUpdateView {
  int layer = 0, expert = 0;
  std::string file;
  double canary = 0;  // share, 0..1
  std::string state;  // loading | canary | promoted | rolled back | failed
  std::vector<int> ranks;
  uint64_t rows = 0, canary_rows = 0;
  std::string error;
};

// How the expert updates ended so far (router 0): each update counts once, when it is promoted,
// rolled back, or fails (loading, promoting or rolling back).
struct ExpertUpdateResults {
  uint64_t promoted = 0, rolled_back = 0, failed = 0;
};

// What router 0 grants a process that joins the job (moerun serve --join).
struct JoinGrant {
  int rank = -1;  // the dead expert rank it takes over
  int ranks = 0, routers = 0;
  // By rank: the transport address of every router (the others left empty: the joiner talks to
  // routers only).
  std::vector<std::vector<uint8_t>> addresses;
  uint64_t placement_version = 0;
  size_t header_bytes = 0;  // the job's dispatch headers (the joiner checks its own)
};
struct JoinAsk {
  std::vector<uint8_t> address;  // the joiner's transport address
  std::string who;               // host and pid, for the log
  // What the joiner computed from its own config, checked against the job's.
  std::vector<int> layers;
  int num_experts = 0;
  // Called once on router 0's thread with the grant or why not.
  std::function<void(Result<JoinGrant>)> done;
};

struct MigrationOptions {
  double throttle_bytes_s = 0;  // per expert rank; 0: unlimited
  int64_t expert_bytes = 0;     // one expert's weights (for the bytes to move)
  std::string trigger = "moectl";
  std::string note;
};

}  // namespace moerun
