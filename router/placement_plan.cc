#include "router/placement_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
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

namespace {

// The expert ranks planned for, in order (planned rank i is live[i]): all but the excluded.
std::vector<int> LiveExpertRanks(const Placement& current, const std::vector<int>& exclude) {
  std::vector<int> live;
  for (int r = current.num_routers(); r < current.num_ranks(); ++r) {
    if (std::find(exclude.begin(), exclude.end(), r) == exclude.end()) live.push_back(r);
  }
  return live;
}

// The nodes of the job (PlanOptions::rank_node) for a plan over `live` (sorted here into
// (node, rank) order where they spread evenly over two or more nodes); 1 where unknown.
Result<int> JobNodes(const PlanOptions& options, std::vector<int>* live) {
  const auto node_of = [&](int r) {
    return static_cast<size_t>(r) < options.rank_node.size()
               ? options.rank_node[static_cast<size_t>(r)]
               : -1;
  };
  std::map<int, int> count;
  for (int r : *live) ++count[node_of(r)];
  if (count.empty() || count.count(-1) || count.size() == 1) return 1;
  const bool even = std::all_of(count.begin(), count.end(),
                                [&](const auto& c) { return c.second == count.begin()->second; });
  if (!even) {
    const bool needs = options.policy == PlannerPolicy::kNodeAware ||
                       options.policy == PlannerPolicy::kNodeLocal ||
                       options.policy == PlannerPolicy::kEplbHierarchical;
    if (!needs) return 1;
    std::string list;
    for (const auto& [node, n] : count) {
      list += fmt::format("{}node {}: {} rank(s)", list.empty() ? "" : ", ", node, n);
    }
    return Status::InvalidArgument(fmt::format(
        "plan: {} needs the same number of live expert ranks on every node ({}); give --nodes 1 "
        "or another policy",
        PlannerPolicyName(options.policy), list));
  }
  std::stable_sort(live->begin(), live->end(),
                   [&](int a, int b) { return node_of(a) < node_of(b); });
  return static_cast<int>(count.size());
}

// The planner's input for the loads over `ranks` live expert ranks, or InvalidArgument for options
// or loads the placement cannot take (`left_out` names the excluded ranks in the messages).
// Each planned rank's capacity (planned rank i is live[i]): one copy of every expert, or what its
// memory holds (options.rank_capacity) where that is fewer.
std::vector<int> LiveCapacities(const PlanOptions& options, const std::vector<int>& live,
                                int experts) {
  std::vector<int> caps(live.size(), experts);
  for (size_t k = 0; k < live.size(); ++k) {
    const auto it = options.rank_capacity.find(live[k]);
    if (it != options.rank_capacity.end()) caps[k] = std::clamp(it->second, 0, experts);
  }
  return caps;
}

// Each planned rank's slots (planned rank i is live[i]) where options.rank_slots names some or a
// rank's capacity is under its even share; empty where neither (then the slots spread evenly,
// PlannerInputFor). The ranks not named share what the named ones leave as evenly as counts
// allow, each at most its capacity (the others then share the rest).
Result<std::vector<int>> GivenRankSlots(const PlanOptions& options, const std::vector<int>& live,
                                        int slots, int experts) {
  if (options.incremental) {
    if (options.rank_slots.empty()) return std::vector<int>();
    return Status::InvalidArgument(
        "plan: --rank-slots plans afresh; --incremental keeps each rank's slots");
  }
  const std::vector<int> cap = LiveCapacities(options, live, experts);
  const auto memory = [&](size_t k) {
    const auto it = options.rank_capacity.find(live[k]);
    return it != options.rank_capacity.end() && it->second < experts;
  };
  std::vector<int> caps(live.size(), -1);
  int given = 0;
  for (const auto& [rank, n] : options.rank_slots) {
    const auto at = std::find(live.begin(), live.end(), rank);
    if (at == live.end()) {
      return Status::InvalidArgument(
          fmt::format("plan: --rank-slots names rank {}, which is not a live expert rank ({})",
                      rank, fmt::join(live, ",")));
    }
    const size_t k = static_cast<size_t>(at - live.begin());
    if (n < 0 || n > cap[k]) {
      return Status::InvalidArgument(
          memory(k) && n >= 0
              ? fmt::format("plan: --rank-slots gives rank {} {} slots; its memory holds {} "
                            "(expert_memory_mib)",
                            rank, n, cap[k])
              : fmt::format("plan: --rank-slots gives rank {} {} slots; a rank holds 0 to {} "
                            "(one per expert)",
                            rank, n, experts));
    }
    caps[k] = n;
    given += n;
  }
  if (given > slots) {
    return Status::InvalidArgument(fmt::format(
        "plan: --rank-slots gives {} slots, the plan has {} (experts + redundant)", given, slots));
  }
  // The others: an even share each, capped (water-filling: a rank whose share exceeds its
  // capacity gets its capacity, and the rest is shared again).
  std::vector<bool> fixed(live.size(), false);
  int left = slots - given;
  while (true) {
    std::vector<size_t> free;
    for (size_t k = 0; k < live.size(); ++k) {
      if (caps[k] < 0 && !fixed[k]) free.push_back(k);
    }
    if (free.empty()) break;
    const std::vector<int> share = EvenRankSlots(std::max(left, 0), static_cast<int>(free.size()));
    bool capped = false;
    for (size_t i = 0; i < free.size(); ++i) {
      if (share[i] > cap[free[i]]) fixed[free[i]] = true, left -= cap[free[i]], capped = true;
    }
    if (capped) continue;
    for (size_t i = 0; i < free.size(); ++i) caps[free[i]] = share[i];
    left = 0;
    break;
  }
  for (size_t k = 0; k < live.size(); ++k) {
    if (fixed[k]) caps[k] = cap[k];
  }
  if (left != 0) {
    std::string held;
    for (size_t k = 0; k < live.size(); ++k) {
      if (memory(k) || options.rank_slots.count(live[k]) > 0) {
        held += fmt::format("{}rank {}: {}", held.empty() ? "" : ", ", live[k], caps[k]);
      }
    }
    return Status::InvalidArgument(fmt::format(
        "plan: the plan has {} slots (experts + redundant), the live expert ranks hold {} "
        "({}{}); give fewer --redundant{}",
        slots, slots - left, held.empty() ? "one copy of each expert" : held,
        held.empty() ? "" : ", the others one copy of each expert at most",
        options.rank_slots.empty() ? "" : " or change --rank-slots"));
  }
  const bool any_memory = std::any_of(fixed.begin(), fixed.end(), [](bool f) { return f; });
  if (options.rank_slots.empty() && !any_memory) return std::vector<int>();
  return caps;
}

// Each planned rank's speed (planned rank i is live[i]; those not named 1) where
// options.rank_speed names some; empty where none is named.
Result<std::vector<double>> LiveSpeeds(const PlanOptions& options, const std::vector<int>& live) {
  if (options.rank_speed.empty()) return std::vector<double>();
  std::vector<double> speed(live.size(), 1.0);
  for (const auto& [rank, v] : options.rank_speed) {
    const auto at = std::find(live.begin(), live.end(), rank);
    if (at == live.end()) {
      return Status::InvalidArgument(
          fmt::format("plan: --rank-speed names rank {}, which is not a live expert rank ({})",
                      rank, fmt::join(live, ",")));
    }
    if (!(v > 0) || !std::isfinite(v)) {
      return Status::InvalidArgument(fmt::format(
          "plan: rank {} has speed {}; a speed must be a finite number above 0", rank, v));
    }
    speed[static_cast<size_t>(at - live.begin())] = v;
  }
  return speed;
}

Result<PlannerInput> PlannerInputFor(const std::map<int, std::vector<double>>& loads,
                                     const Placement& current, const PlanOptions& options,
                                     const std::vector<int>& live, const std::string& left_out) {
  const int ranks = static_cast<int>(live.size());
  const int experts = current.num_experts();
  if (loads.empty()) return Status::InvalidArgument("plan: no layer to plan");
  if (ranks < 1)
    return Status::InvalidArgument("plan: the placement has no expert rank" + left_out);
  if (options.redundant < 0 || options.redundant > 64 * experts) {
    return Status::InvalidArgument("plan: --redundant must be in 0.." +
                                   std::to_string(64 * experts));
  }
  const int slots = experts + options.redundant;
  MOERUN_RETURN_IF_ERROR(CheckCacheExperts(
      options.cache_experts, current.num_ranks() - current.num_routers(), "plan: cache_experts"));
  PlannerInput in;
  in.num_slots = slots;
  MOERUN_ASSIGN_OR_RETURN(in.rank_slots, GivenRankSlots(options, live, slots, experts));
  const bool given_even =
      !in.rank_slots.empty() && std::all_of(in.rank_slots.begin(), in.rank_slots.end(),
                                            [&](int c) { return c == in.rank_slots[0]; });
  if (given_even) in.rank_slots.clear();
  if (!in.rank_slots.empty() && options.policy != PlannerPolicy::kDefault &&
      options.policy != PlannerPolicy::kEplbGlobal) {
    return Status::InvalidArgument(fmt::format(
        "plan: {} needs the same number of slots on every rank; ranks of different slot counts "
        "(--rank-slots, or a rank's memory: expert_memory_mib) plan with default or eplb-global",
        PlannerPolicyName(options.policy)));
  }
  // Slots that do not divide: as evenly as counts allow (the first ranks one more).
  if (in.rank_slots.empty() && slots % ranks != 0) {
    if (options.policy != PlannerPolicy::kDefault && options.policy != PlannerPolicy::kEplbGlobal) {
      const int up = (ranks - slots % ranks) % ranks;
      return Status::InvalidArgument(fmt::format(
          "plan: {} experts + {} redundant = {} slots do not divide evenly over {} expert "
          "ranks{}; {} needs the same number on every rank: use --redundant {}, or --policy "
          "default or eplb-global (any count)",
          experts, options.redundant, slots, ranks, left_out, PlannerPolicyName(options.policy),
          options.redundant + up));
    }
    in.rank_slots = EvenRankSlots(slots, ranks);
  }
  MOERUN_ASSIGN_OR_RETURN(in.rank_speed, LiveSpeeds(options, live));
  // Counts that neither the operator nor memory fixes may follow the speeds.
  in.speed_slots = options.rank_slots.empty() && options.rank_capacity.empty();
  in.num_groups = options.groups < 1 ? 1 : options.groups;
  in.num_nodes = options.nodes < 1 ? 1 : options.nodes;
  in.local_share = options.local_share;
  in.copy_prior = options.copy_prior;
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
  return in;
}

// The expert-cache size of each planned rank (planned rank i is live[i]; 0: no cache).
std::vector<int> LiveCaches(const std::vector<int>& live, int routers,
                            const std::vector<int>& cache_experts) {
  std::vector<int> cache(live.size(), 0);
  for (size_t k = 0; k < cache.size(); ++k) {
    const size_t index = static_cast<size_t>(live[k] - routers);
    if (index < cache_experts.size()) cache[k] = cache_experts[index];
  }
  return cache;
}

// Copies to load: (rank, expert) pairs of the plan that the rank does not hold now.
int CopiesToLoad(const LayerPlacement& cur, const LayerMaps& maps, const std::vector<int>& live,
                 int per_rank) {
  int copies = 0;
  const int ranks = static_cast<int>(live.size());
  for (int rank = 0; rank < ranks; ++rank) {
    std::set<int> have;
    for (int s : cur.rank_slots[static_cast<size_t>(live[static_cast<size_t>(rank)])]) {
      have.insert(cur.slots[static_cast<size_t>(s)].expert);
    }
    std::set<int> want;
    for (int s = rank * per_rank; s < (rank + 1) * per_rank; ++s) {
      if (maps.phy2log[static_cast<size_t>(s)] != kEmptySlot) {
        want.insert(maps.phy2log[static_cast<size_t>(s)]);
      }
    }
    for (int e : want) copies += have.count(e) ? 0 : 1;
  }
  return copies;
}

// The load of each live rank under the current placement and under the plan, each expert's load
// split evenly over its replicas.
std::vector<double> RankLoadBefore(const std::vector<double>& l, const LayerPlacement& cur,
                                   const std::vector<int>& live) {
  std::vector<double> load(live.size(), 0.0);
  for (const Slot& s : cur.slots) {
    const auto e = static_cast<size_t>(s.expert);
    const auto at = std::find(live.begin(), live.end(), s.rank);
    if (e >= l.size() || at == live.end()) continue;
    load[static_cast<size_t>(at - live.begin())] +=
        l[e] / static_cast<double>(cur.replicas[e].size());
  }
  return load;
}

std::vector<double> RankLoadAfter(const std::vector<double>& l, const LayerMaps& maps,
                                  size_t live_ranks, int per_rank) {
  std::vector<double> load(live_ranks, 0.0);
  for (size_t s = 0; s < maps.phy2log.size(); ++s) {
    const auto e = static_cast<size_t>(maps.phy2log[s]);
    if (e < l.size() && s / static_cast<size_t>(per_rank) < live_ranks) {
      load[s / static_cast<size_t>(per_rank)] += l[e] / static_cast<double>(maps.logcnt[e]);
    }
  }
  return load;
}

// What the reports of all layers share.
struct ReportContext {
  const std::vector<int>& live;      // planned rank i is live[i]
  const std::vector<int>& cache;     // per planned rank: its expert-cache size
  const std::vector<double>& speed;  // per planned rank (empty: none given)
  int routers;
  int64_t expert_bytes;
  const PlanOptions& options;
};

// One layer's report: the current placement `cur` against the plan `maps` on the loads `l`.
LayerPlanReport ReportLayer(int layer, const std::vector<double>& l, const LayerPlacement& cur,
                            const LayerMaps& maps, const ReportContext& ctx) {
  const std::vector<int>& live = ctx.live;
  const int ranks = static_cast<int>(live.size());
  const int routers = ctx.routers;
  const PlanOptions& options = ctx.options;
  // (Slots per rank: this layer's; with speeds, layers may differ.)
  const int per_rank = static_cast<int>(maps.phy2log.size()) / ranks;
  LayerPlanReport r;
  r.layer = layer;
  for (double v : l) r.load += static_cast<uint64_t>(std::llround(v));
  r.hit_rate_before = PlacementHitRate(l, cur, routers, options.cache_experts, options.exclude);
  r.hit_rate_after = PredictedHitRate(l, maps, ranks, ctx.cache);
  r.experts_to_load = CopiesToLoad(cur, maps, live, per_rank);
  r.bytes_to_move = static_cast<int64_t>(r.experts_to_load) * ctx.expert_bytes;
  r.ranks = live;
  r.rank_load_before = RankLoadBefore(l, cur, live);
  r.rank_load_after = RankLoadAfter(l, maps, live.size(), per_rank);
  if (ctx.speed.empty()) {
    r.balancedness_before = PlacementBalancedness(l, cur, routers, options.exclude);
    r.balancedness_after = PredictedBalancedness(l, maps, ranks);
  } else {
    r.balancedness_before = TimeBalancedness(r.rank_load_before, ctx.speed);
    r.balancedness_after = PredictedBalancedness(l, maps, ranks, ctx.speed);
  }
  return r;
}

// A layer's entry of the placement table: its slots as [rank, expert] pairs in real rank numbers.
std::string SlotsJson(const LayerPlacement& lp, const std::vector<int>& live, int routers) {
  std::string json;
  for (const Slot& s : lp.slots) {
    const int rank = live[static_cast<size_t>(s.rank - routers)];
    json += fmt::format("{}[{},{}]", json.empty() ? "" : ",", rank, s.expert);
  }
  return json;
}

// Incremental mode: each layer's current placement improved within the budget (the live ranks
// are all the expert ranks: no exclusions here).
Result<std::vector<LayerMaps>> IncrementalPlans(const std::map<int, std::vector<double>>& loads,
                                                const Placement& current,
                                                const PlanOptions& options, int ranks,
                                                int64_t expert_bytes,
                                                const std::vector<double>& speed) {
  if (!options.exclude.empty()) {
    return Status::InvalidArgument(fmt::format(
        "plan: --incremental starts from the running placement, which uses rank(s) {} (left out: "
        "dead); plan without --incremental",
        fmt::join(options.exclude, ",")));
  }
  if (loads.empty()) return Status::InvalidArgument("plan: no layer to plan");
  const int experts = current.num_experts();
  double total = 0;
  std::vector<LayerMaps> plan;
  for (const auto& [layer, l] : loads) {
    const LayerPlacement* lp = current.Layer(layer);
    if (lp == nullptr) {
      return Status::InvalidArgument(fmt::format("plan: the placement has no layer {}", layer));
    }
    if (static_cast<int>(l.size()) != experts) {
      return Status::InvalidArgument(fmt::format(
          "plan: layer {} has loads for {} experts, the placement {}", layer, l.size(), experts));
    }
    MOERUN_ASSIGN_OR_RETURN(LayerMaps maps, FromLayerPlacement(*lp, current.num_routers()));
    const int slots = static_cast<int>(lp->slots.size());  // (maps pads uneven ranks: empties)
    if (options.redundant != 0 && slots != experts + options.redundant) {
      return Status::InvalidArgument(fmt::format(
          "plan: --incremental keeps the placement's {} slots of layer {} ({} redundant), not {} "
          "redundant",
          slots, layer, slots - experts, options.redundant));
    }
    for (double v : l) total += v;
    IncrementalOptions io;
    io.max_moves = options.max_moves;
    if (options.max_bytes > 0 && expert_bytes > 0) {
      // The budget shared evenly by the layers: each makes its best moves first.
      const int64_t fit = options.max_bytes / expert_bytes /
                          static_cast<int64_t>(std::max<size_t>(1, loads.size()));
      if (fit == 0) {  // not one copy fits: the layer stays as it is
        plan.push_back(std::move(maps));
        continue;
      }
      io.max_moves = io.max_moves > 0 ? std::min<int64_t>(io.max_moves, fit) : fit;
    }
    io.target_balance = options.target_balance;
    io.rank_speed = speed;
    MOERUN_ASSIGN_OR_RETURN(IncrementalPlan p, PlanIncremental(l, maps, ranks, io));
    plan.push_back(std::move(p.maps));
  }
  if (!(total > 0)) {
    return Status::InvalidArgument(
        "plan: no load measured yet (send traffic first, or give --loads FILE)");
  }
  return plan;
}

// The "moerun-placement-v1" table of `current`'s job, version + 1, with `layers_json`.
std::string TableJson(const Placement& current, const std::string& layers_json) {
  return fmt::format(
      "{{\"format\": \"moerun-placement-v1\", \"version\": {}, \"num_experts\": {}, "
      "\"num_ranks\": {}, \"num_routers\": {}, \"layers\": {{{}}}}}",
      current.version() + 1, current.num_experts(), current.num_ranks(), current.num_routers(),
      layers_json);
}

std::string RealSlotsJson(const LayerPlacement& lp) {
  std::string json;
  for (const Slot& s : lp.slots) {
    json += fmt::format("{}[{},{}]", json.empty() ? "" : ",", s.rank, s.expert);
  }
  return json;
}

double MaxOf(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, x);
  return m;
}

// The plan within `max_bytes`: the layers by max rank load lowered per byte loaded (a layer that
// loads nothing first), taken while they fit; the others keep `current`'s slots (their reports
// say so).
Result<Placement> WithinBudget(const Placement& current, const Placement& planned,
                               int64_t expert_bytes, int64_t max_bytes, PlanReport* report) {
  struct Candidate {
    size_t index;
    double gain;
    int64_t bytes;
  };
  std::vector<Candidate> order;
  for (size_t i = 0; i < report->layers.size(); ++i) {
    const LayerPlanReport& r = report->layers[i];
    const LayerCost c = CostOfLayer(r.layer, *current.Layer(r.layer), *planned.Layer(r.layer),
                                    current.num_ranks(), current.num_routers(), expert_bytes);
    order.push_back({i, MaxOf(r.rank_load_before) - MaxOf(r.rank_load_after), c.load_bytes});
  }
  std::stable_sort(order.begin(), order.end(), [](const Candidate& a, const Candidate& b) {
    const bool a_free = a.bytes == 0, b_free = b.bytes == 0;
    if (a_free != b_free) return a_free;
    return a.gain * static_cast<double>(b.bytes) > b.gain * static_cast<double>(a.bytes);
  });
  std::vector<bool> take(report->layers.size(), false);
  int64_t used = 0;
  for (const Candidate& c : order) {
    if (c.gain <= 0 && c.bytes > 0) continue;  // costs bytes, gains nothing
    if (used + c.bytes > max_bytes) continue;
    used += c.bytes;
    take[c.index] = true;
  }
  std::string layers_json;
  for (size_t i = 0; i < report->layers.size(); ++i) {
    LayerPlanReport& r = report->layers[i];
    const LayerPlacement& lp = take[i] ? *planned.Layer(r.layer) : *current.Layer(r.layer);
    layers_json +=
        fmt::format("{}\"{}\": [{}]", layers_json.empty() ? "" : ", ", r.layer, RealSlotsJson(lp));
    if (take[i]) continue;
    r.kept = true;
    r.balancedness_after = r.balancedness_before;
    r.hit_rate_after = r.hit_rate_before;
    r.rank_load_after = r.rank_load_before;
    r.experts_to_load = 0;
    r.bytes_to_move = 0;
  }
  report->placement_json = TableJson(current, layers_json);
  return Placement::FromJson(report->placement_json, "plan");
}

}  // namespace

Result<PlanReport> MakePlan(const std::map<int, std::vector<double>>& loads,
                            const Placement& current, int64_t expert_bytes,
                            const PlanOptions& options) {
  const int routers = current.num_routers();
  if (options.max_bytes < 0) return Status::InvalidArgument("plan: the byte budget is negative");
  if (options.incremental && !options.rank_slots.empty()) {
    return Status::InvalidArgument(
        "plan: --rank-slots plans afresh; --incremental keeps each rank's slots");
  }
  if (options.max_bytes > 0 && expert_bytes <= 0) {
    return Status::InvalidArgument(
        "plan: a byte budget needs the bytes of one expert (offline: --expert-bytes)");
  }
  if (options.max_bytes > 0 && !options.exclude.empty()) {
    return Status::InvalidArgument(fmt::format(
        "plan: rank(s) {} are left out (dead): their experts must move whatever it costs; plan "
        "without a byte budget",
        fmt::join(options.exclude, ",")));
  }
  std::vector<int> live = LiveExpertRanks(current, options.exclude);
  const int ranks = static_cast<int>(live.size());
  PlanOptions opts = options;
  if (options.nodes < 1 && !options.incremental) {
    MOERUN_ASSIGN_OR_RETURN(opts.nodes, JobNodes(options, &live));
  }
  const std::string left_out =
      options.exclude.empty()
          ? std::string()
          : fmt::format(" (rank(s) {} left out: dead)", fmt::join(options.exclude, ","));
  const std::vector<int> cache = LiveCaches(live, routers, options.cache_experts);
  // (live is final here: JobNodes may have reordered it by node.)
  MOERUN_ASSIGN_OR_RETURN(const std::vector<double> speed, LiveSpeeds(options, live));
  const auto start = std::chrono::steady_clock::now();
  std::vector<LayerMaps> plan;
  if (options.incremental) {
    MOERUN_RETURN_IF_ERROR(CheckCacheExperts(options.cache_experts, current.num_ranks() - routers,
                                             "plan: cache_experts"));
    MOERUN_ASSIGN_OR_RETURN(plan,
                            IncrementalPlans(loads, current, options, ranks, expert_bytes, speed));
  } else {
    MOERUN_ASSIGN_OR_RETURN(const PlannerInput in,
                            PlannerInputFor(loads, current, opts, live, left_out));
    MOERUN_ASSIGN_OR_RETURN(plan, PlanPlacement(in, options.policy));
    // With expert caches, keep hot experts resident where that does not raise the max rank load
    // (ranks of the same slot count and speed only: the refinement balances load).
    const bool even = std::none_of(plan.begin(), plan.end(), [](const LayerMaps& m) {
      return std::count(m.phy2log.begin(), m.phy2log.end(), kEmptySlot) > 0;
    });
    if (AnyCache(cache) && in.rank_slots.empty() && speed.empty() && even) {
      for (size_t k = 0; k < plan.size(); ++k) {
        plan[k] = ImproveForCache(in.load[k], plan[k], ranks, cache);
      }
    }
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  PlanReport report;
  report.policy = options.incremental ? "incremental" : PlannerPolicyName(options.policy);
  // The most and fewest slots an expert rank holds, over the layers (with speeds, layers may
  // differ).
  report.min_slots_per_rank = std::numeric_limits<int>::max();
  for (const LayerMaps& m : plan) {
    const int per = static_cast<int>(m.phy2log.size()) / ranks;
    report.slots_per_rank = std::max(report.slots_per_rank, per);
    for (int r = 0; r < ranks; ++r) {
      int used = 0;
      for (int x = r * per; x < (r + 1) * per; ++x) {
        used += m.phy2log[static_cast<size_t>(x)] != kEmptySlot ? 1 : 0;
      }
      report.min_slots_per_rank = std::min(report.min_slots_per_rank, used);
    }
  }
  for (size_t k = 0; k < speed.size(); ++k) report.rank_speed[live[k]] = speed[k];
  report.plan_ms_per_layer = ms / static_cast<double>(plan.size());
  const ReportContext ctx{live, cache, speed, routers, expert_bytes, options};
  std::string layers_json;
  size_t i = 0;
  for (const auto& [layer, l] : loads) {
    const LayerMaps& maps = plan[i++];
    report.layers.push_back(ReportLayer(layer, l, *current.Layer(layer), maps, ctx));
    Result<LayerPlacement> lp = ToLayerPlacement(maps, ranks, routers);
    if (!lp.ok()) {
      report.note = fmt::format(
          "layer {}: {} (the placement table holds at most one copy of an "
          "expert per rank; --policy default never plans two)",
          layer, lp.status().message());
      continue;
    }
    layers_json += fmt::format("{}\"{}\": [{}]", layers_json.empty() ? "" : ", ", layer,
                               SlotsJson(*lp, live, routers));
  }
  if (report.note.empty()) {
    report.placement_json = TableJson(current, layers_json);
    MOERUN_ASSIGN_OR_RETURN(Placement next, Placement::FromJson(report.placement_json, "plan"));
    report.max_bytes = options.max_bytes;
    if (options.max_bytes > 0) {
      MOERUN_ASSIGN_OR_RETURN(
          next, WithinBudget(current, next, expert_bytes, options.max_bytes, &report));
    }
    std::vector<int> layers;
    for (const auto& [layer, l] : loads) layers.push_back(layer);
    report.cost = CostOfRebalance(current, next, layers, {expert_bytes});
    // Each layer's part of it (a layer whose slots do not change has no step: nothing moves).
    std::map<int, const LayerCost*> step_of;
    for (const LayerCost& c : report.cost.steps) step_of[c.layer] = &c;
    for (LayerPlanReport& r : report.layers) {
      const auto it = step_of.find(r.layer);
      if (it == step_of.end()) continue;
      r.experts_to_release = it->second->copies_released;
      r.max_rank_bytes = it->second->max_rank_load_bytes;
    }
  }
  return report;
}

}  // namespace moerun
