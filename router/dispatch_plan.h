// The dispatch plan of one microbatch: from its top-k expert ids and the layer's placement,
// which rows go to which rank, for which of that rank's slots, at which offset.
//
// Rows are laid out rank after rank; within a rank, slot after slot in the rank's slot order;
// within a slot, in (token, k) order. So each destination receives one contiguous block whose
// size is known before anything moves, and an expert rank can run each local expert over one
// contiguous run of rows. Among the replicas of an expert, each assignment goes to the replica
// whose rank carries the least load (the load given in, plus what this plan has added so far;
// ties to the first slot). Build allocates nothing once its vectors have grown.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "router/placement.h"

namespace moerun {

struct DispatchPlan {
  int num_ranks = 0;
  std::vector<int64_t> rank_offset;     // ranks + 1: rows of rank d are [rank_offset[d], [d+1])
  std::vector<int32_t> slot_rows;       // per physical slot: rows assigned to it
  std::vector<int32_t> row_token;       // per row: its token
  std::vector<int64_t> assignment_row;  // per (token, k): the row that carries it

  // rank_load (size = ranks) is read for replica choice and increased by the rows planned.
  void Build(const int32_t* ids, int64_t tokens, int k, const LayerPlacement& placement,
             std::span<double> rank_load);
  int64_t rows_to(int rank) const { return rank_offset[rank + 1] - rank_offset[rank]; }

 private:
  std::vector<int32_t> slot_of_;  // per (token, k): chosen slot
  std::vector<int64_t> next_;     // per slot: next free row
};

}  // namespace moerun
