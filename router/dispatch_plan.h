// The dispatch plan of one microbatch: from its top-k expert ids and the layer's placement,
// which rows go to which rank, for which of that rank's slots, at which offset.
//
// Rows are laid out rank after rank; within a rank, slot after slot in the rank's slot order;
// within a slot, in (token, k) order. So each destination receives one contiguous block whose
// size is known before anything moves, and an expert rank can run each local expert over one
// contiguous run of rows. Among the replicas of an expert, each assignment goes to the replica
// whose rank carries the least load (the load given in, plus what this plan has added so far;
// ties to the first slot). Build allocates nothing once its vectors have grown.
//
// With a DispatchLocality (the router's node and every rank's), the choice prefers the router's
// own node: among an expert's copies, the least loaded one on the router's node is taken when its
// rank is not overloaded among its node's ranks: load ≤ (the mean load of the node's ranks that
// hold slots) + spill × m, m = max(1, (their load given in + this plan's rows) ÷ their count), the
// mean they would reach if every row stayed on the node. The node's ranks are compared with each
// other only: a router sees the rows it has in flight, not the other routers' rows on the other
// nodes' ranks. Else the least loaded copy on a node this token already goes to, within the least
// loaded copy's load + spill × (the mean load of all the ranks with slots, this plan included) (a
// hierarchical transport sends a token once per node); else the least loaded copy anywhere.
// spill < 0: no preference (the plain choice), only the counts below. The rows and their order
// per slot are the same whatever copy is chosen, so the answer is too (bitwise).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "router/placement.h"

namespace moerun {

struct DispatchLocality {
  std::span<const int> rank_node;  // per rank, routers included: its node (ids ≥ 0)
  int node = 0;                    // the router's node
  double spill = 0.5;              // the bound's slack; < 0: no preference
};

struct DispatchPlan {
  int num_ranks = 0;
  std::vector<int64_t> rank_offset;     // ranks + 1: rows of rank d are [rank_offset[d], [d+1])
  std::vector<int32_t> slot_rows;       // per physical slot: rows assigned to it
  std::vector<int32_t> row_token;       // per row: its token
  std::vector<int64_t> assignment_row;  // per (token, k): the row that carries it
  // With a DispatchLocality: rows sent to a rank on another node, and (token, other node) pairs
  // (the copies a hierarchical transport would send: one per token and remote node). 0 without.
  int64_t off_node_rows = 0;
  int64_t off_node_token_nodes = 0;

  // rank_load (size = ranks) is read for replica choice and increased by the rows planned.
  void Build(const int32_t* ids, int64_t tokens, int k, const LayerPlacement& placement,
             std::span<double> rank_load, const DispatchLocality* locality = nullptr);
  int64_t rows_to(int rank) const { return rank_offset[rank + 1] - rank_offset[rank]; }

 private:
  std::vector<int32_t> slot_of_;  // per (token, k): chosen slot
  std::vector<int64_t> next_;     // per slot: next free row
};

}  // namespace moerun
