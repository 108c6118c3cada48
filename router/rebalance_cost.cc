#include "router/rebalance_cost.h"

#include <algorithm>
#include <map>
#include <set>

namespace moerun {
namespace {

std::set<int> ExpertsOf(const LayerPlacement& lp, int rank) {
  std::set<int> out;
  if (rank < 0 || static_cast<size_t>(rank) >= lp.rank_slots.size()) return out;
  for (int s : lp.rank_slots[static_cast<size_t>(rank)]) {
    out.insert(lp.slots[static_cast<size_t>(s)].expert);
  }
  return out;
}

}  // namespace

LayerCost CostOfLayer(int layer, const LayerPlacement& from, const LayerPlacement& to,
                      int num_ranks, int num_routers, int64_t expert_bytes) {
  LayerCost c;
  c.layer = layer;
  for (int d = num_routers; d < num_ranks; ++d) {
    const std::set<int> was = ExpertsOf(from, d), will = ExpertsOf(to, d);
    RankMoves m;
    m.rank = d;
    std::set_difference(will.begin(), will.end(), was.begin(), was.end(),
                        std::back_inserter(m.load));
    std::set_difference(was.begin(), was.end(), will.begin(), will.end(),
                        std::back_inserter(m.release));
    if (m.load.empty() && m.release.empty()) continue;
    m.load_bytes = static_cast<int64_t>(m.load.size()) * expert_bytes;
    m.release_bytes = static_cast<int64_t>(m.release.size()) * expert_bytes;
    c.copies_loaded += static_cast<int>(m.load.size());
    c.copies_released += static_cast<int>(m.release.size());
    c.load_bytes += m.load_bytes;
    c.release_bytes += m.release_bytes;
    c.max_rank_load_bytes = std::max(c.max_rank_load_bytes, m.load_bytes);
    c.load_messages += m.load.empty() ? 0 : 1;
    c.release_messages += m.release.empty() ? 0 : 1;
    c.ranks.push_back(std::move(m));
  }
  // Slots that change without any copy moving still make a step: the routers switch.
  if (!Placement::SameSlots(from, to)) c.switch_messages = std::max(0, num_routers - 1);
  return c;
}

RebalanceCost CostOfRebalance(const Placement& from, const Placement& to,
                              const std::vector<int>& layers,
                              const std::vector<int64_t>& expert_bytes) {
  RebalanceCost r;
  if (from.num_ranks() != to.num_ranks() || from.num_routers() != to.num_routers() ||
      from.num_experts() != to.num_experts()) {
    return r;
  }
  std::vector<int> order = layers;
  std::sort(order.begin(), order.end());
  order.erase(std::unique(order.begin(), order.end()), order.end());
  const int64_t json_bytes = static_cast<int64_t>(to.ToJson().size());
  for (int layer : order) {
    const LayerPlacement* a = from.Layer(layer);
    const LayerPlacement* b = to.Layer(layer);
    if (a == nullptr || b == nullptr) continue;
    size_t i = static_cast<size_t>(std::find(layers.begin(), layers.end(), layer) - layers.begin());
    const int64_t bytes = expert_bytes.empty() ? 0
                          : expert_bytes.size() == 1
                              ? expert_bytes[0]
                              : expert_bytes[std::min(i, expert_bytes.size() - 1)];
    LayerCost c = CostOfLayer(layer, *a, *b, to.num_ranks(), to.num_routers(), bytes);
    if (Placement::SameSlots(*a, *b)) continue;
    AddStep(&r, std::move(c), json_bytes);
  }
  return r;
}

void AddStep(RebalanceCost* r, LayerCost c, int64_t placement_bytes) {
  r->copies_loaded += c.copies_loaded;
  r->copies_released += c.copies_released;
  r->load_bytes += c.load_bytes;
  r->release_bytes += c.release_bytes;
  r->critical_bytes += c.max_rank_load_bytes;
  r->messages += c.load_messages + c.switch_messages + c.release_messages;
  r->switch_bytes += static_cast<int64_t>(c.switch_messages) * placement_bytes;
  for (const RankMoves& m : c.ranks) {
    if (m.load_bytes == 0) continue;
    int64_t& total = r->rank_load_bytes[m.rank];
    total += m.load_bytes;
    r->max_rank_bytes = std::max(r->max_rank_bytes, total);
  }
  r->steps.push_back(std::move(c));
}

}  // namespace moerun
