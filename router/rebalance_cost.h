// What a rebalance costs: moving a job from one placement to another as router 0's migration
// does it (runtime/migration/migration_runner.h), counted before anything moves, so that an
// operator (`moectl placement plan`), the automatic mode and `moebench replay` see the price of a
// plan beside its balance.
//
// A migration goes layer by layer, in layer order, one step per layer whose slots change:
//   1. load: every expert rank that gets an expert it holds no copy of is sent one "load"
//      message with its list (in parallel; each answers);
//   2. switch: router 0 switches the layer, sends "switch" with the whole new placement (its JSON)
//      to every other router and "release" with its list to every expert rank that no longer
//      holds some expert (each answers).
// Loads are whole experts (every copy of an expert of one layer has the same bytes); a rank that
// keeps a copy of an expert moves nothing for it, whatever slot numbers change.
//
// Pure functions of their inputs; thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "router/placement.h"

namespace moerun {

struct RankMoves {
  int rank = 0;
  std::vector<int> load, release;  // logical experts, ascending
  int64_t load_bytes = 0, release_bytes = 0;
};

struct LayerCost {
  int layer = 0;
  std::vector<RankMoves> ranks;  // the expert ranks that load or release something, by rank
  int copies_loaded = 0, copies_released = 0;
  int64_t load_bytes = 0, release_bytes = 0;
  int64_t max_rank_load_bytes = 0;  // the step's slowest rank: what bounds its time
  int load_messages = 0;            // ranks that load
  int switch_messages = 0;          // the other routers
  int release_messages = 0;         // ranks that release
};

struct RebalanceCost {
  std::vector<LayerCost> steps;  // the layers that change, in the order they move
  int copies_loaded = 0, copies_released = 0;
  int64_t load_bytes = 0, release_bytes = 0;
  // Σ over the steps of the slowest rank's bytes: at a throttle of T bytes/s per rank
  // (rebalance.throttle_mib_s) the migration takes at least critical_bytes ÷ T.
  int64_t critical_bytes = 0;
  int messages = 0;            // control messages sent (each is answered: as many replies)
  int64_t switch_bytes = 0;    // bytes of the placements sent with the switches
  int64_t max_rank_bytes = 0;  // the most one expert rank loads over the whole migration
  std::map<int, int64_t> rank_load_bytes;  // per expert rank that loads: its bytes in all
};

// `expert_bytes[i]`: the bytes of one expert of layers[i] (or one value for every layer).
// Layers missing from either placement are skipped. `from` and `to` must be for the same job
// (ranks, routers, experts); otherwise the cost of nothing.
RebalanceCost CostOfRebalance(const Placement& from, const Placement& to,
                              const std::vector<int>& layers,
                              const std::vector<int64_t>& expert_bytes);

// Adds one layer's step to `total` (its switches sending `placement_bytes` each). The caller
// leaves out the layers whose slots do not change (Placement::SameSlots).
void AddStep(RebalanceCost* total, LayerCost step, int64_t placement_bytes);

// One layer's step (the same rules), for planners working on layer placements alone
// (`num_routers`: the ranks below the expert ranks). Unchanged slots: no moves, no messages.
LayerCost CostOfLayer(int layer, const LayerPlacement& from, const LayerPlacement& to,
                      int num_ranks, int num_routers, int64_t expert_bytes);

}  // namespace moerun
