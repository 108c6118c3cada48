// The planner's local search (router/planner.h, kDefault and the incremental mode): improves the
// balance of one layer's slots by single moves, each evaluated incrementally.
//
// A move is
//   * a swap of the contents of a slot of the most loaded rank with a slot of another rank, or
//   * a re-assignment of a slot whose expert has several replicas (it gets one fewer, the other
//     expert one more): a slot of the most loaded rank to any expert, or any slot to an expert
//     of the most loaded rank;
// never placing an expert on a rank that already holds it. Each round takes the move that most
// lowers (max rank load, then the sum of squared rank loads, the latter by more than 1e-12
// relative), the first such in slot order (swaps before re-assignments), so the search is
// deterministic. Rank loads, the ranks in load order (the new max of the ranks a move leaves
// alone), each expert's slots and load per replica are kept between moves, updated where a move
// changes them. A candidate costs O(1) (a swap: two new rank loads) or O(replicas × slots per
// rank) (a re-assignment: the ranks of both experts re-summed), and most are cut before that by
// lower bounds on their new max. Rank loads are summed as a from-scratch evaluation sums them and
// a key's sum of squares is made exact (rank after rank) wherever it decides, so the moves are
// those of the simple reference (tests/unit/planner_test.cc: ReferenceImprove), bit for bit.
//
// Then, in the full search, replicas that a rank holds twice (EPLB plans may) are lifted, each by
// the swap or re-assignment that keeps the max rank load lowest without raising it.
//
// Each rank's load: every expert's load split evenly over its slots; slot s on rank s / (slots per
// rank). With ranks of different speed (rank_speed), what is balanced is each rank's time, its
// load ÷ its speed (speeds scaled so that the fastest is 1: a time is then in rows at the fastest
// rank's pace); without, the load itself, bit for bit as before speeds were known (every factor
// is then exactly 1). Pure: calls share no state and may run concurrently.
#pragma once

#include <cstdint>
#include <vector>

#include "router/planner.h"

namespace moerun {

struct SearchLimits {
  // Expert copies the moves may add, counted against the start: (rank, expert) pairs of the
  // result that the start does not have (a swap adds up to 2, a re-assignment up to 1). -1: none.
  int64_t max_copies = -1;
  // Stop once the balance reaches this (0: search until no move helps): mean ÷ max of the rank
  // loads; with speeds, the time of a perfect split (total load ÷ total speed) ÷ the max time.
  double target_balance = 0;
  // Rounds at most; 0: 50 × slots.
  int64_t max_rounds = 0;
  // Stop once this many rounds in a row have not lowered the max rank load (they only lowered the
  // sum of squares); 0: as many as slots; -1: never. On the DeepSeek-R1 files (32 to 256 ranks)
  // the max falls at least every 4 rounds while it falls at all, but at 256 ranks a few searches
  // then spend the whole 50 × slots rounds on the sum of squares alone, without lowering the max
  // again (tests/unit/planner_test.cc: PlateauStopKeepsBalanceOnDeepSeek). -1 makes the moves those
  // of the reference.
  int64_t stall_rounds = -1;
  // Lift replicas held twice on a rank afterwards (the full search; incremental starts hold none).
  bool lift_twice = true;
};

struct SearchResult {
  LayerMaps maps;
  int64_t moves = 0;   // moves made
  int64_t copies = 0;  // (rank, expert) pairs of the result that the start does not have
};

// The search from `start` (its phy2log; num_ranks divides its slots) on one layer's loads;
// rank_speed: each rank's speed (> 0, finite; any unit), or empty: all the same.
SearchResult LocalSearch(const std::vector<double>& load, const LayerMaps& start, int num_ranks,
                         const SearchLimits& limits, const std::vector<double>& rank_speed = {});

// Each rank's time factor for rank_speed: the fastest rank's speed ÷ the rank's (1 for all where
// rank_speed is empty or its speeds are all equal). Speeds must be finite and > 0.
std::vector<double> InverseSpeeds(const std::vector<double>& rank_speed, int num_ranks);

// Maps from phy2log alone: log2phy in slot order.
LayerMaps MapsFromSlots(std::vector<int> phy2log, int num_log);

// Whether a rank of `maps` (num_ranks divides its slots) holds two slots of one expert, which a
// placement table cannot (empty slots never count).
bool HoldsTwice(const LayerMaps& maps, int num_ranks);

}  // namespace moerun
