// A placement plan as operators see it (`moectl placement plan`, a dry run): from measured loads
// and the current placement, the planner's new placement (router/planner.h), the predicted
// balancedness before and after, and the expert weights each rank would have to load. Where expert
// ranks have an expert cache (cache/: more hosted experts than resident ones), the plan is then
// refined to keep hot experts resident (router/cache_plan.h: ImproveForCache, which never raises
// the plan's max rank load) and the report gives the predicted cache hit rates.
// Pure; used by router 0's control endpoint (window loads) and by moectl offline (--loads FILE).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "router/placement.h"
#include "router/planner.h"
#include "router/rebalance_cost.h"

namespace moerun {

struct PlanOptions {
  // Redundant expert slots per layer (slots = experts + redundant): any count; where the slots do
  // not divide over the live expert ranks, the first ranks hold one more (default and eplb-global
  // only: the other policies need the same count on every rank).
  int redundant = 0;
  PlannerPolicy policy = PlannerPolicy::kDefault;
  int groups = 1;  // expert groups (EPLB hierarchical: groups to nodes); 0: as the model's gate
  int nodes = 1;   // nodes the expert ranks span, in order; 0: those rank_node gives (else 1)
  // Per rank of the job (routers included): its node id (-1: unknown). With nodes = 0 and the
  // live expert ranks spread evenly over two or more nodes, the plan's nodes are these (the
  // planner's rank i is then the i-th live expert rank in (node, rank) order); unevenly spread,
  // the node-aware policies (node-aware, node-local, eplb-hierarchical) are refused and the others
  // plan with one node.
  std::vector<int> rank_node;
  // Slots of named expert ranks (rank number -> count, e.g. what its memory holds); the live
  // expert ranks not named share the rest as evenly as counts allow. InvalidArgument for a rank
  // that is not a live expert rank, a count above the experts or below 0, or counts that leave
  // the others fewer than 0 slots (or some when none is left to take them). Not with incremental.
  std::map<int, int> rank_slots;
  // Speeds of named expert ranks (rank number -> rows per second, or any unit the same for all;
  // live expert ranks not named: 1): the plan balances time, each rank's load ÷ its speed
  // (router/planner.h PlannerInput::rank_speed), and, without rank_slots, may give the faster
  // ranks more slots. InvalidArgument for a rank that is not a live expert rank, or a speed that
  // is not a finite number above 0; refused by the EPLB policies (they balance load).
  std::map<int, double> rank_speed;
  // The most slots per layer named expert ranks may hold (rank number -> count: what each one's
  // memory holds, expert_memory_mib; ranks not named: no limit). Where the even share does not
  // fit a rank, it gets what fits and the others share the rest as evenly as counts allow;
  // rank_slots above a rank's capacity, or more slots than all of them hold together:
  // InvalidArgument. Ranks not live are ignored. Not with incremental (it keeps each rank's
  // slots).
  std::map<int, int> rank_capacity;
  double local_share = 0.75;  // node-local's knobs (router/node_local.h)
  double copy_prior = 0;
  // Expert ranks left out (dead): the plan's slots go to the others, none to these.
  std::vector<int> exclude;
  // Per expert rank (index 0 = the first expert rank, whether excluded or not): the experts of
  // each layer its expert cache holds; empty, missing or 0 for a rank: no cache (everything it
  // hosts is resident). Longer than the expert ranks, or negative: InvalidArgument.
  std::vector<int> cache_experts;
  // Incremental mode (router/planner.h PlanIncremental): start from the current placement of each
  // layer (its slots: `redundant`, if not 0, must match them) and improve it by single moves, at
  // most max_moves expert copies loaded per layer (0: no limit), until target_balance (0: none).
  // No expert-cache refinement (it would load copies outside the budget); no excluded ranks.
  bool incremental = false;
  int max_moves = 0;
  double target_balance = 0;
  // Bytes of expert weights the whole rebalance may load (0: no limit; needs expert_bytes). The
  // layers are taken in order of balance gained per byte (max rank load lowered ÷ bytes; a layer
  // that moves nothing first) while they fit; the others keep their current placement. With
  // `incremental`, the budget is shared evenly: each layer's moves are capped at its share
  // (max_bytes ÷ expert_bytes ÷ layers copies), its best moves first. Not
  // with excluded (dead) ranks: their experts must move whatever it costs.
  int64_t max_bytes = 0;
};

struct LayerPlanReport {
  int layer = 0;
  double balancedness_before = 1.0;  // the current placement, on the same loads
  double balancedness_after = 1.0;   // the plan's, predicted
  int experts_to_load = 0;           // (rank, expert) copies the plan adds
  int64_t bytes_to_move = 0;         // their weights
  uint64_t load = 0;                 // assignments the plan is made from
  // The predicted expert-cache hit rate of the current placement and of the plan, on the same
  // loads: each expert's load split evenly over its replicas; on a rank whose cache holds B
  // experts, the B experts it hosts with the most load (ties: the lower expert number) are
  // resident; hit rate = load on resident copies ÷ total load, over the live expert ranks (the
  // excluded ones left out). 1 where all loads are 0 or no rank has a cache.
  double hit_rate_before = 1.0;
  double hit_rate_after = 1.0;
  // The load of each live expert rank (ranks[i], in rank order), each expert's load split evenly
  // over its replicas: under the current placement and under the plan (what the balancedness
  // figures are the mean ÷ max of; moectl placement plan --plot draws them).
  std::vector<int> ranks;
  std::vector<double> rank_load_before, rank_load_after;
  int experts_to_release = 0;  // (rank, expert) copies the plan drops
  int64_t max_rank_bytes = 0;  // the most one expert rank loads for this layer
  bool kept = false;           // kept as it is: max_bytes did not reach it
};

struct PlanReport {
  std::string policy;            // the policy's name, or "incremental"
  int slots_per_rank = 0;        // the most an expert rank holds
  int min_slots_per_rank = 0;    // the fewest (where the slots do not divide over the ranks)
  double plan_ms_per_layer = 0;  // wall time of the planner (and cache refinement) ÷ layers
  std::vector<LayerPlanReport> layers;
  std::string placement_json;  // the new "moerun-placement-v1" table (version + 1)
  std::string note;            // why there is no table, when there is none
  RebalanceCost cost;          // of moving from the current placement to the table
  int64_t max_bytes = 0;       // the budget it was planned within (0: none)
  // The speed of every live expert rank the plan balanced time with (empty: none given); the
  // balancedness figures are then in time (the time of a perfect split ÷ the most loaded rank's).
  std::map<int, double> rank_speed;
};

// loads: per served layer, assignments per logical expert. expert_bytes: the weights of one
// expert (0: report copies only). InvalidArgument for loads that do not match the placement, no
// load at all, slots that do not divide evenly over the expert ranks, or bad cache_experts.
Result<PlanReport> MakePlan(const std::map<int, std::vector<double>>& loads,
                            const Placement& current, int64_t expert_bytes,
                            const PlanOptions& options);

// Mean ÷ max of the expert ranks' loads under a placement (the ranks in `exclude` left out):
// each expert's load split evenly over its replicas.
double PlacementBalancedness(const std::vector<double>& load, const LayerPlacement& placement,
                             int num_routers, const std::vector<int>& exclude = {});

}  // namespace moerun
