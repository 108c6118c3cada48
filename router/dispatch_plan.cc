#include "router/dispatch_plan.h"

#include <algorithm>

namespace moerun {
namespace {

// The slot of the least loaded rank among `reps` (ties: the first).
int LeastLoaded(const std::vector<int>& reps, const LayerPlacement& placement,
                std::span<const double> rank_load) {
  int best = reps[0];
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
  return best;
}

}  // namespace

void DispatchPlan::Build(const int32_t* ids, int64_t tokens, int k, const LayerPlacement& placement,
                         std::span<double> rank_load, const DispatchLocality* locality) {
  num_ranks = static_cast<int>(placement.rank_slots.size());
  const size_t n = static_cast<size_t>(tokens * k);
  const size_t nslots = placement.slots.size();
  slot_rows.assign(nslots, 0);
  slot_of_.resize(n);
  off_node_rows = 0;
  off_node_token_nodes = 0;
  const auto rank_of = [&](int slot) {
    return static_cast<size_t>(placement.slots[static_cast<size_t>(slot)].rank);
  };
  // 1. Choose a slot per assignment: the replica on the least loaded rank (preferring the
  //    router's node, then the token's other nodes, within the bound, where told).
  const bool prefer = locality != nullptr && locality->spill >= 0;
  double slack = 0;        // the bound's rows above the least loaded copy (other nodes)
  double local_slack = 0;  // ... above the mean load of the router's node's ranks
  double local_sum = 0;    // the load of the router's node's ranks
  int local_ranks = 0;
  if (prefer) {
    int serving = 0;
    double before = 0;  // rows already in flight (the runtime's other microbatches)
    for (size_t d = 0; d < placement.rank_slots.size(); ++d) {
      if (placement.rank_slots[d].empty()) continue;
      ++serving;
      before += rank_load[d];
      if (locality->rank_node[d] == locality->node) ++local_ranks, local_sum += rank_load[d];
    }
    slack =
        locality->spill * std::max(1.0, (before + static_cast<double>(n)) / std::max(serving, 1));
    if (local_ranks > 0) {
      local_slack =
          locality->spill * std::max(1.0, (local_sum + static_cast<double>(n)) / local_ranks);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const auto& reps = placement.replicas[static_cast<size_t>(ids[i])];
    int best = reps.size() == 1 ? reps[0] : LeastLoaded(reps, placement, rank_load);
    if (prefer && reps.size() > 1) {
      const std::span<const int> node_of = locality->rank_node;
      const double bound = rank_load[rank_of(best)] + slack;
      const double local_bound = local_ranks > 0 ? local_sum / local_ranks + local_slack : -1.0;
      const size_t first = i - i % static_cast<size_t>(k);  // this token's earlier choices
      int local = -1, visited = -1;
      for (int s : reps) {
        const double load = rank_load[rank_of(s)];
        const int nd = node_of[rank_of(s)];
        if (nd == locality->node) {
          if (load <= local_bound && (local < 0 || load < rank_load[rank_of(local)])) local = s;
          continue;
        }
        if (load > bound) continue;
        bool seen = false;
        for (size_t j = first; j < i && !seen; ++j) seen = node_of[rank_of(slot_of_[j])] == nd;
        if (seen && (visited < 0 || load < rank_load[rank_of(visited)])) visited = s;
      }
      best = local >= 0 ? local : visited >= 0 ? visited : best;
    }
    slot_of_[i] = best;
    ++slot_rows[static_cast<size_t>(best)];
    rank_load[rank_of(best)] += 1.0;
    if (prefer && locality->rank_node[rank_of(best)] == locality->node) local_sum += 1.0;
  }
  if (locality != nullptr) {  // the off-node counts
    const std::span<const int> node_of = locality->rank_node;
    for (size_t t = 0; t < n; t += static_cast<size_t>(k)) {
      for (size_t i = t; i < t + static_cast<size_t>(k); ++i) {
        const int nd = node_of[rank_of(slot_of_[i])];
        if (nd == locality->node) continue;
        ++off_node_rows;
        bool seen = false;
        for (size_t j = t; j < i && !seen; ++j) seen = node_of[rank_of(slot_of_[j])] == nd;
        if (!seen) ++off_node_token_nodes;
      }
    }
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
