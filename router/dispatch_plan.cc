#include "router/dispatch_plan.h"

namespace moerun {

void DispatchPlan::Build(const int32_t* ids, int64_t tokens, int k, const LayerPlacement& placement,
                         std::span<double> rank_load) {
  num_ranks = static_cast<int>(placement.rank_slots.size());
  const size_t n = static_cast<size_t>(tokens * k);
  const size_t nslots = placement.slots.size();
  slot_rows.assign(nslots, 0);
  slot_of_.resize(n);
  // 1. Choose a slot per assignment: the replica on the least loaded rank.
  for (size_t i = 0; i < n; ++i) {
    const auto& reps = placement.replicas[static_cast<size_t>(ids[i])];
    int best = reps[0];
    if (reps.size() > 1) {
      double best_load =
          rank_load[static_cast<size_t>(placement.slots[static_cast<size_t>(best)].rank)];
      for (size_t r = 1; r < reps.size(); ++r) {
        const int s = reps[r];
        const double load =
            rank_load[static_cast<size_t>(placement.slots[static_cast<size_t>(s)].rank)];
        if (load < best_load) {
          best = s;
          best_load = load;
        }
      }
    }
    slot_of_[i] = best;
    ++slot_rows[static_cast<size_t>(best)];
    rank_load[static_cast<size_t>(placement.slots[static_cast<size_t>(best)].rank)] += 1.0;
  }
  // 2. Offsets: rank by rank, slot by slot in the rank's order.
  rank_offset.assign(static_cast<size_t>(num_ranks) + 1, 0);
  next_.assign(nslots, 0);
  int64_t row = 0;
  for (int d = 0; d < num_ranks; ++d) {
    rank_offset[static_cast<size_t>(d)] = row;
    for (int s : placement.rank_slots[static_cast<size_t>(d)]) {
      next_[static_cast<size_t>(s)] = row;
      row += slot_rows[static_cast<size_t>(s)];
    }
  }
  rank_offset[static_cast<size_t>(num_ranks)] = row;
  // 3. Rows in (token, k) order within each slot.
  row_token.resize(n);
  assignment_row.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t r = next_[static_cast<size_t>(slot_of_[i])]++;
    row_token[static_cast<size_t>(r)] = static_cast<int32_t>(i / static_cast<size_t>(k));
    assignment_row[i] = r;
  }
}

}  // namespace moerun
