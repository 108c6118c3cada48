// The placement planner: from the load of a window (assignments per logical expert, per layer), the
// physical expert slots of every rank.
//
// Policies:
//  - kEplbHierarchical, kEplbGlobal: a faithful port of DeepSeek's published EPLB (eplb.py,
//    deepseek-ai/EPLB). Hierarchical: pack expert groups onto nodes (balanced packing), replicate
//    experts within each node (each redundant slot goes to the expert of highest load per replica),
//    pack the node's replicas onto its ranks (balanced packing, an equal number per rank). Global:
//    the same with one group and one node, as eplb.py does. The arithmetic is eplb.py's: loads are
//    converted to float32 and summed/divided in float32; ties as torch 1.13 on the CPU breaks them
//    (std::sort over (value, index) comparing values only, descending; first index of a maximum;
//    the first pack of least weight). tests/data/eplb holds the maps eplb.py gives, which
//    the port reproduces exactly.
//  - kDefault: per layer, both EPLB plans (hierarchical only where num_groups % num_nodes == 0),
//    each then improved by a deterministic local search (router/local_search.h), and the best of
//    the four by PredictedBalancedness (ties: EPLB hierarchical, EPLB global, improved
//    hierarchical, improved global). So it is never worse than EPLB. The local search repeats,
//    while it finds one, the move that most lowers (max rank load, then the sum of squared rank
//    loads):
//      * swap the contents of a slot of the most loaded rank with a slot of another rank;
//      * re-assign a slot of an expert that has several replicas (it gets one fewer, the other
//        expert one more): a slot of the most loaded rank to any expert, or any slot to an expert
//        of the most loaded rank;
//    never placing an expert on a rank that already holds it. It stops after 50 × slots moves, or
//    once `slots` moves in a row have not lowered the max rank load (router/local_search.h).
//    Each candidate move is evaluated incrementally (O(1) for a swap, O(replicas) for a
//    re-assignment, router/local_search.h), the same moves as the from-scratch search it replaced.
//    EPLB plans may hold two replicas of one expert on a rank, which a placement table cannot;
//    the search then lifts such replicas (by a swap or a re-assignment) where that does not raise
//    the max rank load, and among equally balanced candidates the choice prefers one without.
//  - kNodeAware: router/node_planner.h. Experts (or whole expert groups, where the model routes by
//    group) go to nodes so that each sampled token's experts lie on few nodes, each node's load
//    within (1 + node_slack) × the mean; then each node is planned alone by kDefault. Without a
//    routing sample (window counts only), a balanced packing of the units onto the nodes.
//  - kNodeLocal: router/node_local.h. Copies of the hottest experts on every node (for a dispatch
//    that prefers its own node's copies), the rest spread over the nodes by load, each node then
//    planned alone by kDefault.
//  - PlanIncremental (not a policy: it needs the running placement): the same moves from the
//    running placement of a layer, within a budget of expert copies to load, until a target
//    balance is reached or no move helps.
//
// Slots: physical slot s lives on expert rank s / (slots per rank); expert ranks come after the
// router ranks in the job (ToLayerPlacement adds the offset). Ranks may hold different numbers of
// slots (PlannerInput::rank_slots): every rank then has the most any holds, and a rank's slots
// beyond its own count are empty (kEmptySlot in phy2log: nothing is placed there, the table
// leaves them out).
inline constexpr int kEmptySlot = -1;
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "router/placement.h"

namespace moerun {

enum class PlannerPolicy { kEplbHierarchical, kEplbGlobal, kDefault, kNodeAware, kNodeLocal };

// "eplb-hierarchical", "eplb-global", "default", "node-aware", "node-local".
const char* PlannerPolicyName(PlannerPolicy policy);
Result<PlannerPolicy> ParsePlannerPolicy(const std::string& name);

// A sample of the routing: per layer, the top-k ids of the sampled tokens, ids[l][t * top_k + j]
// (a token with any id < 0 is left out). Empty: only window counts are known.
struct RoutingSample {
  int top_k = 0;
  std::vector<std::vector<int32_t>> ids;
};

struct PlannerInput {
  std::vector<std::vector<double>> load;  // [layers][logical experts]: assignments in the window
  int num_slots = 0;   // physical experts per layer = logical + redundant (see rank_slots)
  int num_groups = 1;  // expert groups (divides the experts)
  int num_nodes = 1;   // nodes (divides num_ranks)
  int num_ranks = 1;   // expert ranks (GPUs)
  // kNodeAware only: the tokens whose experts it keeps on few nodes, and how far above the mean
  // node load it may go for that (the knob between balance and locality).
  RoutingSample sample;
  double node_slack = 0.05;
  // kNodeLocal only: the share of the redundant slots that become copies on other nodes (the rest
  // stay with each node for copies inside it), in [0, 1].
  double local_share = 0.75;
  // kNodeLocal only: the loads it plans copies on are the window's + copy_prior × their mean (0:
  // the window's hot experts get the copies; large: copies spread evenly, for unseen traffic).
  double copy_prior = 0;
  // Threads the planner plans layers on (each layer alone, so the plan is the same whatever the
  // count): 0 = one per hardware thread, 1 = the calling thread alone.
  int threads = 0;
  // Each expert rank's slots (its capacity, e.g. from its memory), summing to num_slots, each at
  // most the experts; empty: num_slots ÷ num_ranks each (then num_ranks must divide num_slots).
  // Uneven counts: kDefault and kEplbGlobal only (EPLB's packing into those capacities, then the
  // local search, which never moves an empty slot).
  std::vector<int> rank_slots;
  // Each expert rank's speed (rows per second, or any unit the same for all: measured, calibrated
  // or configured), each finite and > 0; empty: all the same. kDefault (and the node policies,
  // which plan each node by it) then balances time (each rank's load ÷ its speed), not load: the
  // local search's key and every candidate's balance are in time. The EPLB ports balance load
  // only: speeds given to them are refused.
  std::vector<double> rank_speed;
  // With rank_speed and no rank_slots (kDefault): also plan slot counts proportional to the speeds
  // (SpeedRankSlots) and keep whichever plan balances time better (the same counts on every rank
  // among equals). Counts are capacities too: leave this off where memory fixes them.
  bool speed_slots = false;
};

struct LayerMaps {
  std::vector<int> phy2log;               // [slots]: the logical expert of each slot, or kEmptySlot
  std::vector<std::vector<int>> log2phy;  // per logical expert: its slots (EPLB: by replica rank)
  std::vector<int> logcnt;                // per logical expert: its number of slots
};

// The policy eplb.py's rebalance_experts would use: hierarchical iff num_groups % num_nodes == 0.
PlannerPolicy EplbAutoPolicy(const PlannerInput& input);

// The maps of every layer. InvalidArgument on bad input (ragged or empty load, negative or
// non-finite load, num_slots fewer than the experts, not a multiple of num_ranks without
// rank_slots, rank_slots of the wrong size, negative, above the experts or not summing to
// num_slots, or given to a policy other than kDefault and kEplbGlobal, num_groups not dividing the
// experts, num_nodes not dividing num_ranks, kEplbHierarchical where num_groups % num_nodes != 0).
// Deterministic.
Result<std::vector<LayerMaps>> PlanPlacement(const PlannerInput& input, PlannerPolicy policy);

// `slots` spread over `ranks` as evenly as counts allow (the first slots % ranks ranks hold one
// more): PlannerInput::rank_slots where the slots do not divide.
std::vector<int> EvenRankSlots(int slots, int ranks);

// `slots` spread over the ranks in proportion to `speed` (largest remainders; ties: the lower
// rank), each rank at most `max_per_rank` (the experts: one copy of each). A rank far slower than
// the others may get none (its share under half a slot): it then computes nothing.
std::vector<int> SpeedRankSlots(int slots, const std::vector<double>& speed, int max_per_rank);

struct IncrementalOptions {
  int64_t max_moves = 0;           // expert copies (rank, expert) the plan may load; 0: no limit
  double target_balance = 0;       // stop once PredictedBalancedness reaches this; 0: no target
  std::vector<double> rank_speed;  // as PlannerInput's: balance time, not load
};

struct IncrementalPlan {
  LayerMaps maps;             // the same slot count as the running placement
  int64_t moves = 0;          // swaps and re-assignments made
  int64_t experts_moved = 0;  // = BytesToMove(current, maps, num_ranks, 1)
};

// The running placement `current` of one layer (a placement table's: no expert twice on a rank;
// num_ranks divides its slots) improved by the default policy's moves (a swap loads up to two
// expert copies, a re-assignment one), the best move first, until the balance reaches
// options.target_balance, no move within the budget lowers (max rank load, then the sum of
// squared rank loads), or the budget is spent. Never lowers the balance; from a placement no move
// improves, the same placement. InvalidArgument on bad loads, options or placement. Deterministic.
Result<IncrementalPlan> PlanIncremental(const std::vector<double>& load, const LayerMaps& current,
                                        int num_ranks, const IncrementalOptions& options);

// Each expert's load split evenly over its slots; mean ÷ max of the ranks' loads (1 = perfect;
// 1 where all loads are zero). With rank_speed (as PlannerInput's), in time: the time of a perfect
// split (total load ÷ total speed) ÷ the most loaded rank's (its load ÷ its speed); the same as
// without where the speeds are equal.
double PredictedBalancedness(const std::vector<double>& layer_load, const LayerMaps& maps,
                             int num_ranks, const std::vector<double>& rank_speed = {});

// The time balance of rank loads on ranks of these speeds (one each, finite, > 0): a perfect
// split's time (total load ÷ total speed) ÷ the most loaded rank's (load ÷ speed); 1 where all
// loads are zero.
double TimeBalancedness(const std::vector<double>& rank_load, const std::vector<double>& speed);

// InvalidArgument unless `speed` is empty or has one finite speed > 0 per rank.
Status CheckRankSpeeds(const std::vector<double>& speed, int num_ranks);

// Bytes of expert weights to load when going from `from` to `to`: expert_bytes for every
// (rank, logical expert) that `to` places on a rank that holds no copy of it in `from`.
int64_t BytesToMove(const LayerMaps& from, const LayerMaps& to, int num_ranks,
                    int64_t expert_bytes);

// To the runtime's placement of one layer: slot s on rank num_routers + s / (slots per rank);
// rank_slots spans all num_routers + num_ranks ranks. InvalidArgument if the maps are inconsistent
// or place one expert twice on a rank (the placement table forbids that).
Result<LayerPlacement> ToLayerPlacement(const LayerMaps& maps, int num_ranks, int num_routers);
// Back: slots renumbered rank after rank (each rank's slots in slot order); every expert rank must
// hold the same number of slots. log2phy in slot order.
Result<LayerMaps> FromLayerPlacement(const LayerPlacement& placement, int num_routers);
// A whole plan as a placement table (layer i of the plan is layer i of the table).
Result<Placement> ToPlacement(const std::vector<LayerMaps>& plan, int num_ranks, int num_routers,
                              uint64_t version);

}  // namespace moerun
