#include "router/node_local.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "router/local_search.h"

namespace moerun {
namespace {

// One layer with `keep` redundant slots kept for copies inside the nodes.
Result<LayerMaps> PlanLayerKeeping(const PlannerInput& in, size_t layer,
                                   const std::vector<double>& load0, int keep) {
  const int experts = static_cast<int>(load0.size());
  std::vector<double> load = load0;
  // The window's loads pulled towards their mean by copy_prior (for traffic unlike the window's).
  const double mean = std::accumulate(load0.begin(), load0.end(), 0.0) / experts;
  for (double& v : load) v += in.copy_prior * mean;
  const int nodes = in.num_nodes;
  const int slots_per_node = in.num_slots / nodes;
  const int redundant = in.num_slots - experts;
  // 1. Node-level copies, and each node's room for distinct experts.
  const int cross = redundant - keep;
  std::vector<int> room(static_cast<size_t>(nodes), slots_per_node - keep / nodes);
  for (int n = 0; n < keep % nodes; ++n) --room[static_cast<size_t>(n)];
  std::vector<int> order(static_cast<size_t>(experts));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return load[static_cast<size_t>(a)] > load[static_cast<size_t>(b)];
  });
  std::vector<int> copies(static_cast<size_t>(experts), 1);
  int left = cross;
  for (int e : order) {
    if (left == 0) break;
    const int add = std::min(nodes - 1, left);
    copies[static_cast<size_t>(e)] += add;
    left -= add;
  }
  // 2. Which nodes hold each expert.
  std::vector<std::vector<int>> mine(static_cast<size_t>(nodes));
  std::vector<double> node_load(static_cast<size_t>(nodes), 0.0);
  const auto per_copy = [&](int e) {
    return load[static_cast<size_t>(e)] / copies[static_cast<size_t>(e)];
  };
  std::vector<int> rest;
  for (int e : order) {
    if (copies[static_cast<size_t>(e)] == nodes) {
      for (int n = 0; n < nodes; ++n) {
        mine[static_cast<size_t>(n)].push_back(e);
        node_load[static_cast<size_t>(n)] += per_copy(e);
        --room[static_cast<size_t>(n)];
      }
    } else {
      rest.push_back(e);
    }
  }
  // The expert with copies on several (not all) nodes first, while every node has room; then by
  // load per copy, heaviest first.
  std::stable_sort(rest.begin(), rest.end(), [&](int a, int b) {
    const int ca = copies[static_cast<size_t>(a)], cb = copies[static_cast<size_t>(b)];
    return ca != cb ? ca > cb : per_copy(a) > per_copy(b);
  });
  // The sampled tokens of each expert, and the nodes that each token's placed experts already
  // touch (a bit per node; only where the nodes fit a mask), to keep co-used experts together.
  const bool co_use = nodes <= 64 && layer < in.sample.ids.size() && in.sample.top_k > 0;
  std::vector<std::vector<int32_t>> tokens_of(static_cast<size_t>(co_use ? experts : 0));
  std::vector<uint64_t> touched;
  if (co_use) {
    const auto& ids = in.sample.ids[layer];
    const size_t k = static_cast<size_t>(in.sample.top_k);
    touched.assign(ids.size() / k, 0);
    for (size_t t = 0; t < ids.size() / k; ++t) {
      const int32_t* row = ids.data() + t * k;
      if (std::any_of(row, row + k, [&](int32_t e) { return e < 0 || e >= experts; })) continue;
      for (size_t j = 0; j < k; ++j) tokens_of[static_cast<size_t>(row[j])].push_back(int32_t(t));
    }
  }
  const double total = std::accumulate(node_load.begin(), node_load.end(), 0.0) +
                       std::accumulate(rest.begin(), rest.end(), 0.0,
                                       [&](double a, int e) { return a + load[size_t(e)]; });
  const double limit = total / nodes * (1 + in.node_slack) * (1 + 1e-12);
  std::vector<int64_t> score(static_cast<size_t>(nodes));
  for (int e : rest) {
    std::vector<bool> holds(static_cast<size_t>(nodes), false);
    std::fill(score.begin(), score.end(), 0);
    if (co_use) {
      for (int32_t t : tokens_of[static_cast<size_t>(e)]) {
        for (int n = 0; n < nodes; ++n) score[size_t(n)] += (touched[size_t(t)] >> n) & 1U;
      }
    }
    for (int c = 0; c < copies[static_cast<size_t>(e)]; ++c) {
      // The node whose tokens use this expert most, within the load limit; else the lightest.
      int best = -1, lightest = -1;
      for (int n = 0; n < nodes; ++n) {
        const size_t un = static_cast<size_t>(n);
        if (holds[un] || room[un] <= 0) continue;
        if (lightest < 0 || node_load[un] < node_load[size_t(lightest)]) lightest = n;
        if (node_load[un] + per_copy(e) > limit) continue;
        if (best < 0 || score[un] > score[size_t(best)] ||
            (score[un] == score[size_t(best)] && node_load[un] < node_load[size_t(best)])) {
          best = n;
        }
      }
      if (best < 0) best = lightest;
      if (best < 0) {
        return Status::Internal(
            fmt::format("planner: node-local found no node with room for expert {}", e));
      }
      holds[static_cast<size_t>(best)] = true;
      mine[static_cast<size_t>(best)].push_back(e);
      node_load[static_cast<size_t>(best)] += per_copy(e);
      --room[static_cast<size_t>(best)];
      if (co_use) {
        for (int32_t t : tokens_of[static_cast<size_t>(e)])
          touched[size_t(t)] |= uint64_t{1} << best;
      }
    }
  }
  // 3. Each node alone, renumbered into the layer's slots.
  std::vector<int> phy2log(static_cast<size_t>(in.num_slots), -1);
  for (int n = 0; n < nodes; ++n) {
    std::vector<int>& here = mine[static_cast<size_t>(n)];
    std::sort(here.begin(), here.end());
    PlannerInput sub;
    sub.load.emplace_back();
    for (int e : here) sub.load[0].push_back(per_copy(e));
    sub.num_slots = slots_per_node;
    sub.num_ranks = in.num_ranks / nodes;
    if (!in.rank_speed.empty()) {  // the node's ranks balanced by time among themselves
      const auto first = in.rank_speed.begin() + static_cast<std::ptrdiff_t>(n * sub.num_ranks);
      sub.rank_speed.assign(first, first + static_cast<std::ptrdiff_t>(sub.num_ranks));
    }
    sub.threads = 1;
    MOERUN_ASSIGN_OR_RETURN(std::vector<LayerMaps> plan,
                            PlanPlacement(sub, PlannerPolicy::kDefault));
    for (int s = 0; s < slots_per_node; ++s) {
      phy2log[static_cast<size_t>(n * slots_per_node + s)] =
          here[static_cast<size_t>(plan[0].phy2log[static_cast<size_t>(s)])];
    }
  }
  return MapsFromSlots(std::move(phy2log), experts);
}

// One layer: the share's copies inside the nodes, fewer where a node's plan would need an expert
// twice on one of its ranks (few ranks a node, or few experts), none at the last.
Result<LayerMaps> PlanLayer(const PlannerInput& in, size_t layer) {
  const int redundant = in.num_slots - static_cast<int>(in.load[layer].size());
  int keep = redundant - static_cast<int>(std::floor(in.local_share * redundant + 1e-9));
  if (in.num_ranks / in.num_nodes == 1) keep = 0;  // one rank a node: no copy inside it
  for (;;) {
    MOERUN_ASSIGN_OR_RETURN(LayerMaps m, PlanLayerKeeping(in, layer, in.load[layer], keep));
    if (!HoldsTwice(m, in.num_ranks)) return m;
    if (keep == 0) {
      return Status::Internal(
          fmt::format("planner: node-local placed an expert twice on a rank in layer {}", layer));
    }
    keep /= 2;
  }
}

}  // namespace

Result<std::vector<LayerMaps>> PlanNodeLocal(const PlannerInput& in) {
  if (!(in.local_share >= 0 && in.local_share <= 1)) {
    return Status::InvalidArgument(
        fmt::format("planner: local_share {} is not in [0, 1]", in.local_share));
  }
  if (!(in.copy_prior >= 0) || !std::isfinite(in.copy_prior)) {
    return Status::InvalidArgument(
        fmt::format("planner: copy_prior {} is not a finite number >= 0", in.copy_prior));
  }
  if (in.num_nodes <= 1) return PlanPlacement(in, PlannerPolicy::kDefault);
  std::vector<LayerMaps> plan(in.load.size());
  for (size_t l = 0; l < in.load.size(); ++l) {
    MOERUN_ASSIGN_OR_RETURN(plan[l], PlanLayer(in, l));
  }
  return plan;
}

}  // namespace moerun
