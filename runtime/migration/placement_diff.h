// What changes for one rank between two placements of a layer (the migrations' and the switches'
// arithmetic). Pure functions.
#pragma once

#include <set>
#include <vector>

#include "router/placement.h"

namespace moerun {

// Logical experts of `rank` in a layer placement.
inline std::set<int> ExpertsOn(const LayerPlacement& lp, int rank) {
  std::set<int> out;
  for (int s : lp.rank_slots[static_cast<size_t>(rank)]) {
    out.insert(lp.slots[static_cast<size_t>(s)].expert);
  }
  return out;
}

// The elements of `a` not in `b`, in order.
inline std::vector<int> Minus(const std::set<int>& a, const std::set<int>& b) {
  std::vector<int> out;
  for (int x : a) {
    if (b.count(x) == 0) out.push_back(x);
  }
  return out;
}

}  // namespace moerun
