// Grouping a batch's (token, expert) assignments by expert: the single-process dispatch plan.
//
// Given top-k expert ids for T tokens, Build orders the T*k assignments by expert (then token,
// then slot), so each expert sees one contiguous run of rows, and records for every (token, slot)
// the row that will hold its expert output. Counting sort: O(T*k + E), deterministic.
// Not thread-safe; reuse one instance per batch stream (its vectors keep their capacity).
#pragma once

#include <cstdint>
#include <vector>

namespace moerun {

struct ExpertGroups {
  int num_experts = 0;
  std::vector<int64_t> offset;     // num_experts + 1: rows of expert e are [offset[e], offset[e+1])
  std::vector<int32_t> row_token;  // token of each row
  std::vector<int64_t> slot_row;   // [T * k]: row holding the output of (token, slot)
  std::vector<int64_t> next_;      // scratch, kept so that Build allocates nothing once warm

  void Build(const int32_t* ids, int64_t tokens, int k, int num_experts);
  int64_t rows(int e) const { return offset[e + 1] - offset[e]; }
};

}  // namespace moerun
