#include "router/placement_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "router/cache_plan.h"

namespace moerun {
namespace {

double MeanOverMaxD(const std::vector<double>& v) {
  double most = 0, total = 0;
  for (double x : v) {
    most = std::max(most, x);
    total += x;
  }
  return most <= 0 || v.empty() ? 1.0 : total / static_cast<double>(v.size()) / most;
}

}  // namespace

double PlacementBalancedness(const std::vector<double>& load, const LayerPlacement& placement,
                             int num_routers, const std::vector<int>& exclude) {
  const size_t ranks = placement.rank_slots.size();
  std::vector<double> per_rank(ranks > static_cast<size_t>(num_routers) ? ranks - num_routers : 0,
                               0.0);
  for (const Slot& s : placement.slots) {
    const auto e = static_cast<size_t>(s.expert);
    if (e >= load.size() || s.rank < num_routers) continue;
    per_rank[static_cast<size_t>(s.rank - num_routers)] +=
        load[e] / static_cast<double>(placement.replicas[e].size());
  }
  std::vector<double> kept;
  for (size_t i = 0; i < per_rank.size(); ++i) {
    const int rank = static_cast<int>(i) + num_routers;
    if (std::find(exclude.begin(), exclude.end(), rank) == exclude.end()) {
      kept.push_back(per_rank[i]);
    }
  }
  return MeanOverMaxD(kept);
}

Result<PlanReport> MakePlan(const std::map<int, std::vector<double>>& loads,
                            const Placement& current, int64_t expert_bytes,
                            const PlanOptions& options) {
  const int experts = current.num_experts();
  const int routers = current.num_routers();
  // The expert ranks planned for, in order: planned rank i is live[i].
  std::vector<int> live;
  for (int r = routers; r < current.num_ranks(); ++r) {
    if (std::find(options.exclude.begin(), options.exclude.end(), r) == options.exclude.end()) {
      live.push_back(r);
    }
  }
  const int ranks = static_cast<int>(live.size());
  const std::string left_out =
      options.exclude.empty()
          ? std::string()
          : fmt::format(" (rank(s) {} left out: dead)", fmt::join(options.exclude, ","));
  if (loads.empty()) return Status::InvalidArgument("plan: no layer to plan");
  if (ranks < 1)
    return Status::InvalidArgument("plan: the placement has no expert rank" + left_out);
  if (options.redundant < 0 || options.redundant > 64 * experts) {
    return Status::InvalidArgument("plan: --redundant must be in 0.." +
                                   std::to_string(64 * experts));
  }
  const int slots = experts + options.redundant;
  MOERUN_RETURN_IF_ERROR(CheckCacheExperts(options.cache_experts, current.num_ranks() - routers,
                                           "plan: cache_experts"));
  if (slots % ranks != 0) {
    const int up = (ranks - slots % ranks) % ranks;
    return Status::InvalidArgument(fmt::format(
        "plan: {} experts + {} redundant = {} slots do not divide evenly over {} expert ranks{}; "
        "use --redundant {}",
        experts, options.redundant, slots, ranks, left_out, options.redundant + up));
  }
  PlannerInput in;
  in.num_slots = slots;
  in.num_groups = options.groups < 1 ? 1 : options.groups;
  in.num_nodes = options.nodes < 1 ? 1 : options.nodes;
  in.num_ranks = ranks;
  double total = 0;
  for (const auto& [layer, l] : loads) {
    if (static_cast<int>(l.size()) != experts) {
      return Status::InvalidArgument(fmt::format(
          "plan: layer {} has loads for {} experts, the placement {}", layer, l.size(), experts));
    }
    if (current.Layer(layer) == nullptr) {
      return Status::InvalidArgument(fmt::format("plan: the placement has no layer {}", layer));
    }
    for (double v : l) total += v;
    in.load.push_back(l);
  }
  if (!(total > 0)) {
    return Status::InvalidArgument(
        "plan: no load measured yet (send traffic first, or give "
        "--loads FILE)");
  }
  MOERUN_ASSIGN_OR_RETURN(std::vector<LayerMaps> plan, PlanPlacement(in, options.policy));
  // The caches of the planned ranks (planned rank i is live[i]); with any, keep hot experts
  // resident where that does not raise the max rank load.
  std::vector<int> cache(static_cast<size_t>(ranks), 0);
  for (size_t k = 0; k < cache.size(); ++k) {
    const size_t index = static_cast<size_t>(live[k] - routers);
    if (index < options.cache_experts.size()) cache[k] = options.cache_experts[index];
  }
  if (AnyCache(cache)) {
    for (size_t k = 0; k < plan.size(); ++k) {
      plan[k] = ImproveForCache(in.load[k], plan[k], ranks, cache);
    }
  }

  PlanReport report;
  report.policy = PlannerPolicyName(options.policy);
  report.slots_per_rank = slots / ranks;
  std::string layers_json;
  size_t i = 0;
  for (const auto& [layer, l] : loads) {
    const LayerMaps& maps = plan[i++];
    const LayerPlacement& cur = *current.Layer(layer);
    LayerPlanReport r;
    r.layer = layer;
    for (double v : l) r.load += static_cast<uint64_t>(std::llround(v));
    r.balancedness_before = PlacementBalancedness(l, cur, routers, options.exclude);
    r.balancedness_after = PredictedBalancedness(l, maps, ranks);
    r.hit_rate_before = PlacementHitRate(l, cur, routers, options.cache_experts, options.exclude);
    r.hit_rate_after = PredictedHitRate(l, maps, ranks, cache);
    // Copies to load: (rank, expert) pairs of the plan that the rank does not hold now.
    const int per_rank = slots / ranks;
    for (int rank = 0; rank < ranks; ++rank) {
      std::set<int> have;
      for (int s : cur.rank_slots[static_cast<size_t>(live[static_cast<size_t>(rank)])]) {
        have.insert(cur.slots[static_cast<size_t>(s)].expert);
      }
      std::set<int> want;
      for (int s = rank * per_rank; s < (rank + 1) * per_rank; ++s) {
        want.insert(maps.phy2log[static_cast<size_t>(s)]);
      }
      for (int e : want) r.experts_to_load += have.count(e) ? 0 : 1;
    }
    r.bytes_to_move = static_cast<int64_t>(r.experts_to_load) * expert_bytes;
    r.ranks = live;
    r.rank_load_before.assign(live.size(), 0.0);
    for (const Slot& s : cur.slots) {
      const auto e = static_cast<size_t>(s.expert);
      const auto at = std::find(live.begin(), live.end(), s.rank);
      if (e >= l.size() || at == live.end()) continue;
      r.rank_load_before[static_cast<size_t>(at - live.begin())] +=
          l[e] / static_cast<double>(cur.replicas[e].size());
    }
    r.rank_load_after.assign(live.size(), 0.0);
    for (size_t s = 0; s < maps.phy2log.size(); ++s) {
      const auto e = static_cast<size_t>(maps.phy2log[s]);
      if (e < l.size() && s / static_cast<size_t>(per_rank) < live.size()) {
        r.rank_load_after[s / static_cast<size_t>(per_rank)] +=
            l[e] / static_cast<double>(maps.logcnt[e]);
      }
    }
    report.layers.push_back(r);
    Result<LayerPlacement> lp = ToLayerPlacement(maps, ranks, routers);
    if (!lp.ok()) {
      report.note = fmt::format(
          "layer {}: {} (the placement table holds at most one copy of an "
          "expert per rank; --policy default never plans two)",
          layer, lp.status().message());
      continue;
    }
    std::string slots_json;
    for (const Slot& s : lp->slots) {
      const int rank = live[static_cast<size_t>(s.rank - routers)];
      slots_json += fmt::format("{}[{},{}]", slots_json.empty() ? "" : ",", rank, s.expert);
    }
    layers_json +=
        fmt::format("{}\"{}\": [{}]", layers_json.empty() ? "" : ", ", layer, slots_json);
  }
  if (report.note.empty()) {
    report.placement_json = fmt::format(
        "{{\"format\": \"moerun-placement-v1\", \"version\": {}, \"num_experts\": {}, "
        "\"num_ranks\": {}, \"num_routers\": {}, \"layers\": {{{}}}}}",
        current.version() + 1, experts, current.num_ranks(), routers, layers_json);
    MOERUN_RETURN_IF_ERROR(Placement::FromJson(report.placement_json, "plan").status());
  }
  return report;
}

}  // namespace moerun
