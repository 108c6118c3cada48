#include "router/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <utility>

#include "base/thread_pool.h"
#include "router/local_search.h"
#include "router/node_local.h"
#include "router/node_planner.h"

namespace moerun {
namespace {

using FRow = std::vector<float>;
using IRow = std::vector<int64_t>;

// eplb.py balanced_packing on one row: items sorted by weight, descending (torch 1.13's CPU sort
// is std::sort over (value, index) comparing values only; so is this one, so equal weights come
// out in the same order), each to the first pack of least weight that still has room.
void BalancedPacking(const FRow& weight, int num_packs, IRow* pack_index, IRow* rank_in_pack) {
  const size_t n = weight.size();
  const size_t per_pack = n / static_cast<size_t>(num_packs);
  pack_index->assign(n, -1);
  rank_in_pack->assign(n, -1);
  if (per_pack == 1) {
    for (size_t i = 0; i < n; ++i)
      (*pack_index)[i] = static_cast<int64_t>(i), (*rank_in_pack)[i] = 0;
    return;
  }
  std::vector<std::pair<float, int64_t>> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = {weight[i], static_cast<int64_t>(i)};
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return (!std::isnan(a.first) && std::isnan(b.first)) || (a.first > b.first);
  });
  std::vector<float> pack_weight(static_cast<size_t>(num_packs), 0.0f);
  std::vector<size_t> pack_items(static_cast<size_t>(num_packs), 0);
  for (const auto& [w, item] : order) {
    size_t best = SIZE_MAX;
    for (size_t p = 0; p < pack_weight.size(); ++p) {
      if (pack_items[p] >= per_pack) continue;
      if (best == SIZE_MAX || pack_weight[p] < pack_weight[best]) best = p;
    }
    (*pack_index)[static_cast<size_t>(item)] = static_cast<int64_t>(best);
    (*rank_in_pack)[static_cast<size_t>(item)] = static_cast<int64_t>(pack_items[best]);
    pack_weight[best] += w;
    ++pack_items[best];
  }
}

// eplb.py replicate_experts on one row: each redundant slot to the first expert of highest
// load per replica (float32).
void ReplicateExperts(const FRow& weight, int num_phy, IRow* phy2log, IRow* rank, IRow* logcnt) {
  const size_t num_log = weight.size();
  phy2log->resize(static_cast<size_t>(num_phy));
  rank->assign(static_cast<size_t>(num_phy), 0);
  logcnt->assign(num_log, 1);
  for (size_t i = 0; i < num_log; ++i) (*phy2log)[i] = static_cast<int64_t>(i);
  for (size_t i = num_log; i < static_cast<size_t>(num_phy); ++i) {
    size_t best = 0;
    float best_v = 0;
    for (size_t e = 0; e < num_log; ++e) {
      const float v = weight[e] / static_cast<float>((*logcnt)[e]);
      if (e == 0 || v > best_v) best = e, best_v = v;
    }
    (*phy2log)[i] = static_cast<int64_t>(best);
    (*rank)[i] = (*logcnt)[best];
    ++(*logcnt)[best];
  }
}

IRow Inverse(const IRow& perm) {
  IRow inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i)
    inv[static_cast<size_t>(perm[i])] = static_cast<int64_t>(i);
  return inv;
}

// eplb.py rebalance_experts_hierarchical followed by rebalance_experts' log2phy, for one layer
// (eplb.py's rows are independent).
LayerMaps EplbLayer(const std::vector<double>& load, int num_phy, int num_groups, int num_nodes,
                    int num_gpus) {
  const int num_log = static_cast<int>(load.size());
  const int group_size = num_log / num_groups;
  const int groups_per_node = num_groups / num_nodes;
  const int phy_per_gpu = num_phy / num_gpus;
  const int log_per_node = num_log / num_nodes;
  const int phy_per_node = num_phy / num_nodes;
  FRow weight(load.size());
  for (size_t e = 0; e < load.size(); ++e) weight[e] = static_cast<float>(load[e]);

  // Step 1: pack groups to nodes.
  FRow tokens_per_group(static_cast<size_t>(num_groups), 0.0f);
  for (int g = 0; g < num_groups; ++g) {
    float s = 0.0f;
    for (int k = 0; k < group_size; ++k) s += weight[static_cast<size_t>(g * group_size + k)];
    tokens_per_group[static_cast<size_t>(g)] = s;
  }
  IRow group_pack, group_rank;
  BalancedPacking(tokens_per_group, num_nodes, &group_pack, &group_rank);
  IRow log2mlog(static_cast<size_t>(num_log));
  for (int e = 0; e < num_log; ++e) {
    const size_t g = static_cast<size_t>(e / group_size);
    log2mlog[static_cast<size_t>(e)] =
        (group_pack[g] * groups_per_node + group_rank[g]) * group_size + e % group_size;
  }
  const IRow mlog2log = Inverse(log2mlog);

  // Steps 2 and 3, node by node: replicate within the node, pack its replicas onto its GPUs.
  std::vector<int> phy2log(static_cast<size_t>(num_phy));
  IRow pphyrank(static_cast<size_t>(num_phy));
  IRow mlogcnt_all(static_cast<size_t>(num_log));
  for (int node = 0; node < num_nodes; ++node) {
    FRow tokens_per_mlog(static_cast<size_t>(log_per_node));
    for (int j = 0; j < log_per_node; ++j) {
      tokens_per_mlog[static_cast<size_t>(j)] =
          weight[static_cast<size_t>(mlog2log[static_cast<size_t>(node * log_per_node + j)])];
    }
    IRow phy2mlog, phyrank, mlogcnt;
    ReplicateExperts(tokens_per_mlog, phy_per_node, &phy2mlog, &phyrank, &mlogcnt);
    FRow tokens_per_phy(static_cast<size_t>(phy_per_node));
    for (int p = 0; p < phy_per_node; ++p) {
      const size_t m = static_cast<size_t>(phy2mlog[static_cast<size_t>(p)]);
      tokens_per_phy[static_cast<size_t>(p)] = tokens_per_mlog[m] / static_cast<float>(mlogcnt[m]);
    }
    IRow pack, rank_in_pack;
    BalancedPacking(tokens_per_phy, num_gpus / num_nodes, &pack, &rank_in_pack);
    IRow phy2pphy(static_cast<size_t>(phy_per_node));
    for (size_t p = 0; p < phy2pphy.size(); ++p)
      phy2pphy[p] = pack[p] * phy_per_gpu + rank_in_pack[p];
    const IRow pphy2phy = Inverse(phy2pphy);
    for (int q = 0; q < phy_per_node; ++q) {
      const size_t p = static_cast<size_t>(pphy2phy[static_cast<size_t>(q)]);
      const int64_t mlog = phy2mlog[p] + node * log_per_node;
      const size_t out = static_cast<size_t>(node * phy_per_node + q);
      phy2log[out] = static_cast<int>(mlog2log[static_cast<size_t>(mlog)]);
      pphyrank[out] = phyrank[p];
    }
    for (int j = 0; j < log_per_node; ++j) {
      mlogcnt_all[static_cast<size_t>(node * log_per_node + j)] = mlogcnt[static_cast<size_t>(j)];
    }
  }
  LayerMaps maps;
  maps.phy2log = std::move(phy2log);
  maps.logcnt.resize(static_cast<size_t>(num_log));
  maps.log2phy.resize(static_cast<size_t>(num_log));
  for (int e = 0; e < num_log; ++e) {
    const int cnt =
        static_cast<int>(mlogcnt_all[static_cast<size_t>(log2mlog[static_cast<size_t>(e)])]);
    maps.logcnt[static_cast<size_t>(e)] = cnt;
    maps.log2phy[static_cast<size_t>(e)].assign(static_cast<size_t>(cnt), -1);
  }
  for (int s = 0; s < num_phy; ++s) {
    const size_t e = static_cast<size_t>(maps.phy2log[static_cast<size_t>(s)]);
    maps.log2phy[e][static_cast<size_t>(pphyrank[static_cast<size_t>(s)])] = s;
  }
  return maps;
}

std::vector<double> RankLoads(const std::vector<double>& load, const std::vector<int>& phy2log,
                              const std::vector<int>& cnt, int num_ranks) {
  std::vector<double> rank_load(static_cast<size_t>(num_ranks), 0.0);
  const size_t per_rank = phy2log.size() / static_cast<size_t>(num_ranks);
  for (size_t s = 0; s < phy2log.size(); ++s) {
    if (phy2log[s] == kEmptySlot) continue;
    const size_t e = static_cast<size_t>(phy2log[s]);
    rank_load[s / per_rank] += load[e] / cnt[e];
  }
  return rank_load;
}

// A plan the placement table can hold: every second copy of an expert on one rank goes to the
// expert with the most load per copy that this rank does not hold yet (ties: lower index).
LayerMaps Repair(const std::vector<double>& load, const LayerMaps& start, int num_ranks) {
  std::vector<int> p2l = start.phy2log;
  const int num_log = static_cast<int>(load.size());
  const size_t per_rank = p2l.size() / static_cast<size_t>(num_ranks);
  std::vector<int> cnt(static_cast<size_t>(num_log), 0);
  for (int e : p2l) {
    if (e != kEmptySlot) ++cnt[static_cast<size_t>(e)];
  }
  for (size_t r = 0; r < static_cast<size_t>(num_ranks); ++r) {
    std::set<int> here;
    for (size_t s = r * per_rank; s < (r + 1) * per_rank; ++s) here.insert(p2l[s]);
    std::set<int> seen;
    for (size_t s = r * per_rank; s < (r + 1) * per_rank; ++s) {
      if (p2l[s] == kEmptySlot || seen.insert(p2l[s]).second) continue;
      int best = -1;
      for (int e = 0; e < num_log; ++e) {
        if (here.count(e)) continue;
        if (best < 0 ||
            load[static_cast<size_t>(e)] / (cnt[static_cast<size_t>(e)] + 1) >
                load[static_cast<size_t>(best)] / (cnt[static_cast<size_t>(best)] + 1)) {
          best = e;
        }
      }
      if (best < 0) continue;  // the rank holds every expert already: nothing better to put here
      --cnt[static_cast<size_t>(p2l[s])];
      ++cnt[static_cast<size_t>(best)];
      p2l[s] = best;
      here.insert(best);
      seen.insert(best);
    }
  }
  return MapsFromSlots(std::move(p2l), num_log);
}

Status CheckInput(const PlannerInput& in, PlannerPolicy policy) {
  if (in.load.empty()) return Status::InvalidArgument("planner: no layers in the load");
  const size_t experts = in.load[0].size();
  if (experts == 0) return Status::InvalidArgument("planner: no experts in the load");
  for (size_t l = 0; l < in.load.size(); ++l) {
    if (in.load[l].size() != experts) {
      return Status::InvalidArgument(fmt::format(
          "planner: layer {} has {} expert loads, layer 0 has {}", l, in.load[l].size(), experts));
    }
    for (size_t e = 0; e < experts; ++e) {
      const double v = in.load[l][e];
      if (!(v >= 0) || !std::isfinite(static_cast<float>(v))) {
        return Status::InvalidArgument(fmt::format(
            "planner: layer {} expert {}: load {} is not a finite non-negative number", l, e, v));
      }
    }
  }
  const int num_log = static_cast<int>(experts);
  if (in.num_ranks < 1) return Status::InvalidArgument("planner: num_ranks must be at least 1");
  if (in.num_slots < num_log) {
    return Status::InvalidArgument(
        fmt::format("planner: {} slots are fewer than the {} experts: every expert needs one",
                    in.num_slots, num_log));
  }
  if (in.rank_slots.empty() && in.num_slots % in.num_ranks != 0) {
    return Status::InvalidArgument(
        fmt::format("planner: {} slots are not a multiple of the {} ranks (give each rank's slots)",
                    in.num_slots, in.num_ranks));
  }
  if (!in.rank_slots.empty()) {
    if (in.rank_slots.size() != static_cast<size_t>(in.num_ranks)) {
      return Status::InvalidArgument(fmt::format("planner: slots given for {} ranks, not {}",
                                                 in.rank_slots.size(), in.num_ranks));
    }
    int64_t sum = 0;
    for (size_t r = 0; r < in.rank_slots.size(); ++r) {
      const int c = in.rank_slots[r];
      if (c < 0 || c > num_log) {
        return Status::InvalidArgument(fmt::format(
            "planner: expert rank {} is given {} slots; it may hold 0 to {} (one per expert)", r, c,
            num_log));
      }
      sum += c;
    }
    if (sum != in.num_slots) {
      return Status::InvalidArgument(fmt::format(
          "planner: the ranks' slots sum to {}, not the {} slots planned", sum, in.num_slots));
    }
    const bool uneven = std::any_of(in.rank_slots.begin(), in.rank_slots.end(),
                                    [&](int c) { return c != in.rank_slots[0]; });
    if (uneven && policy != PlannerPolicy::kDefault && policy != PlannerPolicy::kEplbGlobal) {
      return Status::InvalidArgument(fmt::format(
          "planner: {} needs the same number of slots on every rank; ranks with different slot "
          "counts are planned by default or eplb-global",
          PlannerPolicyName(policy)));
    }
  }
  MOERUN_RETURN_IF_ERROR(CheckRankSpeeds(in.rank_speed, in.num_ranks));
  if (!in.rank_speed.empty() &&
      (policy == PlannerPolicy::kEplbGlobal || policy == PlannerPolicy::kEplbHierarchical)) {
    return Status::InvalidArgument(fmt::format(
        "planner: {} balances load, not time; ranks of different speed are planned by default, "
        "node-aware or node-local",
        PlannerPolicyName(policy)));
  }
  if (in.num_groups < 1 || num_log % in.num_groups != 0) {
    return Status::InvalidArgument(fmt::format(
        "planner: {} expert groups do not divide the {} experts", in.num_groups, num_log));
  }
  if (in.num_nodes < 1 || in.num_ranks % in.num_nodes != 0) {
    return Status::InvalidArgument(
        fmt::format("planner: {} nodes do not divide the {} ranks", in.num_nodes, in.num_ranks));
  }
  if (policy == PlannerPolicy::kEplbHierarchical && in.num_groups % in.num_nodes != 0) {
    return Status::InvalidArgument(fmt::format(
        "planner: eplb-hierarchical needs the {} nodes to divide the {} expert groups (EPLB "
        "uses its global policy here)",
        in.num_nodes, in.num_groups));
  }
  return Status::Ok();
}

}  // namespace

const char* PlannerPolicyName(PlannerPolicy policy) {
  switch (policy) {
    case PlannerPolicy::kEplbHierarchical:
      return "eplb-hierarchical";
    case PlannerPolicy::kEplbGlobal:
      return "eplb-global";
    case PlannerPolicy::kDefault:
      return "default";
    case PlannerPolicy::kNodeAware:
      return "node-aware";
    case PlannerPolicy::kNodeLocal:
      return "node-local";
  }
  return "?";
}

Result<PlannerPolicy> ParsePlannerPolicy(const std::string& name) {
  for (PlannerPolicy p :
       {PlannerPolicy::kEplbHierarchical, PlannerPolicy::kEplbGlobal, PlannerPolicy::kDefault,
        PlannerPolicy::kNodeAware, PlannerPolicy::kNodeLocal}) {
    if (name == PlannerPolicyName(p)) return p;
  }
  return Status::InvalidArgument(fmt::format(
      "unknown planner policy \"{}\" (eplb-hierarchical, eplb-global, default, node-aware or "
      "node-local)",
      name));
}

PlannerPolicy EplbAutoPolicy(const PlannerInput& input) {
  return input.num_nodes > 0 && input.num_groups % input.num_nodes == 0
             ? PlannerPolicy::kEplbHierarchical
             : PlannerPolicy::kEplbGlobal;
}

namespace {

// The default policy's full local search from one start (see local_search.h).
LayerMaps Improve(const std::vector<double>& load, const LayerMaps& start, int num_ranks,
                  const std::vector<double>& speed) {
  SearchLimits limits;
  limits.stall_rounds = 0;  // stop on a plateau of the max (local_search.h)
  return LocalSearch(load, start, num_ranks, limits, speed).maps;
}

// The best of `candidates` the placement table can hold (no expert twice on a rank); only if
// there is none, the best of all; the first among equals. In time where speeds are given.
LayerMaps BestForTable(const std::vector<double>& load, std::vector<LayerMaps> candidates,
                       int num_ranks, const std::vector<double>& speed) {
  size_t best = 0;
  double best_b = PredictedBalancedness(load, candidates[0], num_ranks, speed);
  bool best_twice = HoldsTwice(candidates[0], num_ranks);
  for (size_t c = 1; c < candidates.size(); ++c) {
    const double b = PredictedBalancedness(load, candidates[c], num_ranks, speed);
    const bool twice = HoldsTwice(candidates[c], num_ranks);
    if ((best_twice && !twice) || (twice == best_twice && b > best_b)) {
      best = c, best_b = b, best_twice = twice;
    }
  }
  return std::move(candidates[best]);
}

// EPLB's global plan for ranks of `caps` slots (uneven; slot s on rank s / the most): the plan of
// the layer padded with zero-load "void" experts, one per empty slot (ids from the experts'
// count: EPLB never gives them a second slot, all real experts coming first among equal loads);
// then each void on a rank with more of them than it has empty slots is swapped with the
// lightest slot (load per copy; one whose expert the void's rank does not hold first) of a rank
// with fewer; the voids become kEmptySlot.
LayerMaps EplbUneven(const std::vector<double>& load, const std::vector<int>& caps) {
  const int experts = static_cast<int>(load.size());
  const int ranks = static_cast<int>(caps.size());
  const int per = *std::max_element(caps.begin(), caps.end());
  int voids = 0;
  for (int c : caps) voids += per - c;
  std::vector<double> padded_load = load;
  padded_load.resize(static_cast<size_t>(experts + voids), 0.0);
  const LayerMaps padded = EplbLayer(padded_load, per * ranks, 1, 1, ranks);
  std::vector<int> p2l = padded.phy2log;
  const auto rank_slots = [&](int r) {
    return std::pair<size_t, size_t>(static_cast<size_t>(r * per),
                                     static_cast<size_t>((r + 1) * per));
  };
  std::vector<int> extra(static_cast<size_t>(ranks), 0);  // voids on the rank less its empties
  for (int r = 0; r < ranks; ++r) {
    const auto [lo, hi] = rank_slots(r);
    int v = 0;
    for (size_t x = lo; x < hi; ++x) v += p2l[x] >= experts ? 1 : 0;
    extra[static_cast<size_t>(r)] = v - (per - caps[static_cast<size_t>(r)]);
  }
  const auto weight = [&](int e) {
    return load[static_cast<size_t>(e)] / padded.logcnt[static_cast<size_t>(e)];
  };
  for (int a = 0; a < ranks; ++a) {
    while (extra[static_cast<size_t>(a)] > 0) {
      const auto [alo, ahi] = rank_slots(a);
      size_t i = alo;
      while (p2l[i] < experts) ++i;  // a void on rank a
      std::set<int> held(p2l.begin() + static_cast<std::ptrdiff_t>(alo),
                         p2l.begin() + static_cast<std::ptrdiff_t>(ahi));
      size_t best = p2l.size();
      bool best_held = true;
      for (int b = 0; b < ranks; ++b) {
        if (extra[static_cast<size_t>(b)] >= 0) continue;
        const auto [blo, bhi] = rank_slots(b);
        for (size_t j = blo; j < bhi; ++j) {
          if (p2l[j] >= experts) continue;
          const bool h = held.count(p2l[j]) > 0;
          if (best == p2l.size() || (best_held && !h) ||
              (h == best_held && weight(p2l[j]) < weight(p2l[best]))) {
            best = j, best_held = h;
          }
        }
      }
      std::swap(p2l[i], p2l[best]);
      --extra[static_cast<size_t>(a)];
      ++extra[best / static_cast<size_t>(per)];
    }
  }
  for (int& e : p2l) {
    if (e >= experts) e = kEmptySlot;
  }
  return MapsFromSlots(std::move(p2l), experts);
}

// kDefault and kEplbGlobal for ranks of uneven slot counts: EplbUneven, and (kDefault) that plan
// improved by the local search (which never moves an empty slot); the better one the table can
// hold.
LayerMaps UnevenLayer(const std::vector<double>& load, const PlannerInput& in, PlannerPolicy policy,
                      const std::vector<int>& caps) {
  LayerMaps start = EplbUneven(load, caps);
  if (policy == PlannerPolicy::kEplbGlobal) return start;
  std::vector<LayerMaps> candidates;
  candidates.push_back(Improve(load, start, in.num_ranks, in.rank_speed));
  if (HoldsTwice(start, in.num_ranks)) {
    candidates.push_back(
        Improve(load, Repair(load, start, in.num_ranks), in.num_ranks, in.rank_speed));
  }
  candidates.push_back(std::move(start));
  return BestForTable(load, std::move(candidates), in.num_ranks, in.rank_speed);
}

// Ranks of different speed whose counts are free (PlannerInput::speed_slots): `plan`, or the
// plan for slot counts in proportion to the speeds where it balances time better.
LayerMaps WithSpeedSlots(const std::vector<double>& load, const PlannerInput& in, LayerMaps plan) {
  if (!in.speed_slots || in.rank_speed.empty()) return plan;
  const std::vector<int> caps =
      SpeedRankSlots(in.num_slots, in.rank_speed, static_cast<int>(load.size()));
  int64_t sum = 0;
  for (int c : caps) sum += c;
  if (sum != in.num_slots || caps == in.rank_slots ||
      std::all_of(caps.begin(), caps.end(), [&](int c) { return c == caps[0]; })) {
    return plan;
  }
  std::vector<LayerMaps> candidates;
  candidates.push_back(std::move(plan));
  candidates.push_back(UnevenLayer(load, in, PlannerPolicy::kDefault, caps));
  return BestForTable(load, std::move(candidates), in.num_ranks, in.rank_speed);
}

// kDefault on one layer (see planner.h): the EPLB plans, each improved, the best that the
// placement table can hold.
LayerMaps DefaultLayer(const std::vector<double>& load, const PlannerInput& in) {
  std::vector<LayerMaps> candidates;
  if (in.num_groups % in.num_nodes == 0) {
    candidates.push_back(EplbLayer(load, in.num_slots, in.num_groups, in.num_nodes, in.num_ranks));
  }
  candidates.push_back(EplbLayer(load, in.num_slots, 1, 1, in.num_ranks));
  const size_t eplb_plans = candidates.size();
  for (size_t c = 0; c < eplb_plans; ++c) {
    candidates.push_back(Improve(load, candidates[c], in.num_ranks, in.rank_speed));
  }
  // Plans that hold an expert twice on a rank cannot be applied: add their repaired forms.
  const size_t plans = candidates.size();
  for (size_t c = 0; c < plans; ++c) {
    if (HoldsTwice(candidates[c], in.num_ranks)) {
      LayerMaps fixed = Repair(load, candidates[c], in.num_ranks);
      if (!HoldsTwice(fixed, in.num_ranks)) {
        candidates.push_back(Improve(load, fixed, in.num_ranks, in.rank_speed));
      }
    }
  }
  return WithSpeedSlots(load, in,
                        BestForTable(load, std::move(candidates), in.num_ranks, in.rank_speed));
}

}  // namespace

std::vector<int> EvenRankSlots(int slots, int ranks) {
  std::vector<int> out;
  for (int r = 0; r < ranks; ++r) out.push_back(slots / ranks + (r < slots % ranks ? 1 : 0));
  return out;
}

std::vector<int> SpeedRankSlots(int slots, const std::vector<double>& speed, int max_per_rank) {
  const int ranks = static_cast<int>(speed.size());
  if (ranks == 0) return {};
  // Each rank's share of the slots, with the room under max_per_rank as a cap: water-filling (a
  // rank at its cap takes no more; the rest share what is left by speed).
  std::vector<int> out(static_cast<size_t>(ranks), 0);
  int left = slots;
  while (left > 0) {
    double sum = 0;
    for (int r = 0; r < ranks; ++r) {
      if (out[static_cast<size_t>(r)] < max_per_rank) sum += speed[static_cast<size_t>(r)];
    }
    if (sum <= 0) break;
    // Largest remainders of this round's shares (ties: the lower rank).
    std::vector<std::pair<double, int>> rem;
    int given = 0;
    for (int r = 0; r < ranks; ++r) {
      int& c = out[static_cast<size_t>(r)];
      if (c >= max_per_rank) continue;
      const double share = left * speed[static_cast<size_t>(r)] / sum;
      const int whole = std::min(static_cast<int>(share), max_per_rank - c);
      c += whole;
      given += whole;
      if (c < max_per_rank) rem.push_back({share - std::floor(share), r});
    }
    left -= given;
    if (given == 0) {
      std::stable_sort(rem.begin(), rem.end(),
                       [](const auto& a, const auto& b) { return a.first > b.first; });
      for (const auto& [frac, r] : rem) {
        if (left == 0) break;
        ++out[static_cast<size_t>(r)];
        --left;
      }
      if (rem.empty()) break;
    }
  }
  return out;
}

Status CheckRankSpeeds(const std::vector<double>& speed, int num_ranks) {
  if (speed.empty()) return Status::Ok();
  if (speed.size() != static_cast<size_t>(num_ranks)) {
    return Status::InvalidArgument(
        fmt::format("planner: speeds given for {} expert ranks, not {}", speed.size(), num_ranks));
  }
  for (size_t r = 0; r < speed.size(); ++r) {
    if (!(speed[r] > 0) || !std::isfinite(speed[r])) {
      return Status::InvalidArgument(fmt::format(
          "planner: expert rank {} has speed {}; a speed must be a finite number above 0", r,
          speed[r]));
    }
  }
  return Status::Ok();
}

Result<std::vector<LayerMaps>> PlanPlacement(const PlannerInput& in, PlannerPolicy policy) {
  MOERUN_RETURN_IF_ERROR(CheckInput(in, policy));
  if (policy == PlannerPolicy::kNodeAware) return PlanNodeAware(in);
  if (policy == PlannerPolicy::kNodeLocal) return PlanNodeLocal(in);
  const bool uneven = std::any_of(in.rank_slots.begin(), in.rank_slots.end(),
                                  [&](int c) { return c != in.rank_slots[0]; });
  // Layers are independent: each is planned alone, on whichever thread takes it (the same
  // plan as one thread's, layer by layer).
  std::vector<LayerMaps> plan(in.load.size());
  const auto one = [&](int64_t l, int) {
    const std::vector<double>& load = in.load[static_cast<size_t>(l)];
    LayerMaps& out = plan[static_cast<size_t>(l)];
    if (uneven) {
      out = UnevenLayer(load, in, policy, in.rank_slots);
      if (policy == PlannerPolicy::kDefault) out = WithSpeedSlots(load, in, std::move(out));
      return;
    }
    switch (policy) {
      case PlannerPolicy::kEplbHierarchical:
        out = EplbLayer(load, in.num_slots, in.num_groups, in.num_nodes, in.num_ranks);
        break;
      case PlannerPolicy::kEplbGlobal:
        out = EplbLayer(load, in.num_slots, 1, 1, in.num_ranks);
        break;
      case PlannerPolicy::kDefault:
        out = DefaultLayer(load, in);
        break;
      case PlannerPolicy::kNodeAware:  // planned above
      case PlannerPolicy::kNodeLocal:
        break;
    }
  };
  const int64_t layers = static_cast<int64_t>(in.load.size());
  int threads = in.threads > 0 ? in.threads : static_cast<int>(std::thread::hardware_concurrency());
  threads = static_cast<int>(std::min<int64_t>(std::max(threads, 1), layers));
  // The EPLB ports take microseconds a layer: threads would cost more than they save.
  if (threads <= 1 || policy != PlannerPolicy::kDefault) {
    for (int64_t l = 0; l < layers; ++l) one(l, 0);
  } else {
    ThreadPool pool(threads);
    pool.ParallelFor(layers, one);
  }
  return plan;
}

Result<IncrementalPlan> PlanIncremental(const std::vector<double>& load, const LayerMaps& current,
                                        int num_ranks, const IncrementalOptions& options) {
  const size_t slots = current.phy2log.size();
  if (num_ranks < 1 || slots == 0 || slots % static_cast<size_t>(num_ranks) != 0) {
    return Status::InvalidArgument(fmt::format(
        "planner: {} slots do not spread evenly over {} expert ranks", slots, num_ranks));
  }
  for (size_t e = 0; e < load.size(); ++e) {
    if (!(load[e] >= 0) || !std::isfinite(load[e])) {
      return Status::InvalidArgument(fmt::format(
          "planner: expert {}: load {} is not a finite non-negative number", e, load[e]));
    }
  }
  if (options.max_moves < 0) {
    return Status::InvalidArgument("planner: the incremental move budget must be 0 or more");
  }
  if (!(options.target_balance >= 0 && options.target_balance <= 1)) {
    return Status::InvalidArgument(
        fmt::format("planner: target balancedness {} is not in [0, 1]", options.target_balance));
  }
  MOERUN_RETURN_IF_ERROR(CheckRankSpeeds(options.rank_speed, num_ranks));
  MOERUN_RETURN_IF_ERROR(ToLayerPlacement(current, num_ranks, 0).status());
  if (current.log2phy.size() != load.size()) {
    return Status::InvalidArgument(fmt::format("planner: {} expert loads for a placement of {}",
                                               load.size(), current.log2phy.size()));
  }
  SearchLimits limits;
  limits.max_copies = options.max_moves > 0 ? options.max_moves : -1;
  limits.target_balance = options.target_balance;
  limits.lift_twice = false;
  SearchResult r = LocalSearch(load, current, num_ranks, limits, options.rank_speed);
  IncrementalPlan plan;
  plan.maps = std::move(r.maps);
  plan.moves = r.moves;
  plan.experts_moved = r.copies;
  return plan;
}

double PredictedBalancedness(const std::vector<double>& layer_load, const LayerMaps& maps,
                             int num_ranks, const std::vector<double>& rank_speed) {
  if (num_ranks < 1 || maps.phy2log.empty()) return 1.0;
  std::vector<int> cnt(layer_load.size(), 0);
  for (int e : maps.phy2log) {
    if (e != kEmptySlot) ++cnt[static_cast<size_t>(e)];
  }
  const std::vector<double> rank_load = RankLoads(layer_load, maps.phy2log, cnt, num_ranks);
  if (rank_speed.size() == static_cast<size_t>(num_ranks)) {
    return TimeBalancedness(rank_load, rank_speed);
  }
  double sum = 0, max = 0;
  for (double v : rank_load) sum += v, max = std::max(max, v);
  if (max <= 0) return 1.0;
  return sum / num_ranks / max;
}

double TimeBalancedness(const std::vector<double>& rank_load, const std::vector<double>& speed) {
  const std::vector<double> inv = InverseSpeeds(speed, static_cast<int>(rank_load.size()));
  double sum = 0, max = 0, speeds = 0;
  for (size_t r = 0; r < rank_load.size(); ++r) {
    sum += rank_load[r];
    max = std::max(max, rank_load[r] * inv[r]);
    speeds += 1 / inv[r];
  }
  return max <= 0 ? 1.0 : sum / speeds / max;
}

int64_t BytesToMove(const LayerMaps& from, const LayerMaps& to, int num_ranks,
                    int64_t expert_bytes) {
  if (num_ranks < 1) return 0;
  const size_t from_per = std::max<size_t>(1, from.phy2log.size() / static_cast<size_t>(num_ranks));
  const size_t to_per = std::max<size_t>(1, to.phy2log.size() / static_cast<size_t>(num_ranks));
  std::set<std::pair<size_t, int>> had, need;
  for (size_t s = 0; s < from.phy2log.size(); ++s) had.insert({s / from_per, from.phy2log[s]});
  for (size_t s = 0; s < to.phy2log.size(); ++s) {
    if (to.phy2log[s] != kEmptySlot) need.insert({s / to_per, to.phy2log[s]});
  }
  int64_t n = 0;
  for (const auto& x : need) n += had.count(x) == 0 ? 1 : 0;
  return n * expert_bytes;
}

Result<LayerPlacement> ToLayerPlacement(const LayerMaps& maps, int num_ranks, int num_routers) {
  const size_t slots = maps.phy2log.size();
  const size_t num_log = maps.log2phy.size();
  if (num_ranks < 1 || num_routers < 0 || slots == 0 || slots % static_cast<size_t>(num_ranks)) {
    return Status::InvalidArgument(fmt::format(
        "planner: {} slots do not spread evenly over {} expert ranks", slots, num_ranks));
  }
  const size_t per_rank = slots / static_cast<size_t>(num_ranks);
  LayerPlacement lp;
  lp.replicas.resize(num_log);
  lp.rank_slots.resize(static_cast<size_t>(num_routers + num_ranks));
  std::set<std::pair<int, int>> seen;
  for (size_t s = 0; s < slots; ++s) {
    const int e = maps.phy2log[s];
    const int rank = num_routers + static_cast<int>(s / per_rank);
    if (e == kEmptySlot) continue;  // a rank with fewer slots
    if (e < 0 || static_cast<size_t>(e) >= num_log) {
      return Status::InvalidArgument(
          fmt::format("planner: slot {} names expert {} of {}", s, e, num_log));
    }
    if (!seen.insert({rank, e}).second) {
      return Status::InvalidArgument(fmt::format(
          "planner: expert {} has two slots on rank {}; a placement holds one", e, rank));
    }
    const int slot = static_cast<int>(lp.slots.size());
    lp.slots.push_back(Slot{rank, e});
    lp.replicas[static_cast<size_t>(e)].push_back(slot);
    lp.rank_slots[static_cast<size_t>(rank)].push_back(slot);
  }
  for (size_t e = 0; e < num_log; ++e) {
    if (lp.replicas[e].empty()) {
      return Status::InvalidArgument(fmt::format("planner: expert {} has no slot", e));
    }
  }
  return lp;
}

Result<LayerMaps> FromLayerPlacement(const LayerPlacement& placement, int num_routers) {
  const int ranks = static_cast<int>(placement.rank_slots.size());
  if (num_routers < 0 || ranks <= num_routers) {
    return Status::InvalidArgument("planner: the placement has no expert rank");
  }
  size_t per_rank = 0;  // the most any expert rank holds; the others' last slots are empty
  for (int r = num_routers; r < ranks; ++r) {
    per_rank = std::max(per_rank, placement.rank_slots[static_cast<size_t>(r)].size());
  }
  if (per_rank == 0) return Status::InvalidArgument("planner: no expert rank holds a slot");
  std::vector<int> phy2log;
  for (int r = 0; r < ranks; ++r) {
    const auto& rs = placement.rank_slots[static_cast<size_t>(r)];
    if (r < num_routers) {
      if (!rs.empty()) {
        return Status::InvalidArgument(
            fmt::format("planner: router rank {} holds {} slots; routers hold none", r, rs.size()));
      }
      continue;
    }
    for (int s : rs) phy2log.push_back(placement.slots[static_cast<size_t>(s)].expert);
    phy2log.insert(phy2log.end(), per_rank - rs.size(), kEmptySlot);
  }
  return MapsFromSlots(std::move(phy2log), static_cast<int>(placement.replicas.size()));
}

Result<Placement> ToPlacement(const std::vector<LayerMaps>& plan, int num_ranks, int num_routers,
                              uint64_t version) {
  if (plan.empty()) return Status::InvalidArgument("planner: an empty plan");
  nlohmann::json layers = nlohmann::json::object();
  for (size_t l = 0; l < plan.size(); ++l) {
    MOERUN_ASSIGN_OR_RETURN(LayerPlacement lp, ToLayerPlacement(plan[l], num_ranks, num_routers));
    nlohmann::json slots = nlohmann::json::array();
    for (const Slot& s : lp.slots) slots.push_back({s.rank, s.expert});
    layers[std::to_string(l)] = std::move(slots);
  }
  const nlohmann::json doc = {{"format", "moerun-placement-v1"},
                              {"version", version},
                              {"num_experts", plan[0].log2phy.size()},
                              {"num_ranks", num_routers + num_ranks},
                              {"num_routers", num_routers},
                              {"layers", layers}};
  return Placement::FromJson(doc.dump(), "planner");
}

}  // namespace moerun
