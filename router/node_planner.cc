#include "router/node_planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "router/local_search.h"

namespace moerun {
namespace {

// One layer's assignment of units to nodes, with what the refinement needs kept current.
class NodePartition {
 public:
  // unit_load[u], unit_size[u]: the load and the experts of unit u; tokens[t]: the units token t
  // uses (distinct, ascending); a node may hold at most max_load and max_size experts.
  NodePartition(std::vector<double> unit_load, std::vector<int> unit_size,
                std::vector<std::vector<int>> tokens, int num_nodes, double max_load, int max_size)
      : load_(std::move(unit_load)),
        size_(std::move(unit_size)),
        tokens_(std::move(tokens)),
        nodes_(num_nodes),
        max_load_(max_load),
        max_size_(max_size),
        node_of_(load_.size(), -1),
        node_load_(static_cast<size_t>(num_nodes), 0.0),
        node_size_(static_cast<size_t>(num_nodes), 0),
        count_(tokens_.size() * static_cast<size_t>(num_nodes), 0),
        unit_tokens_(load_.size()) {
    for (size_t t = 0; t < tokens_.size(); ++t) {
      for (int u : tokens_[t]) unit_tokens_[static_cast<size_t>(u)].push_back(static_cast<int>(t));
    }
  }

  // The greedy start by shared tokens (see node_planner.h); where it leaves a node over the load
  // limit, a balanced packing instead (heaviest unit to the lightest node with room for its
  // experts), and the limit becomes at least that packing's heaviest node.
  void Start() {
    std::vector<int> order(load_.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return load_[static_cast<size_t>(a)] > load_[static_cast<size_t>(b)];
    });
    for (int u : order) Place(u, GreedyNode(u, /*by_tokens=*/true));
    if (*std::max_element(node_load_.begin(), node_load_.end()) <= max_load_) return;
    for (int u : order) Remove(u);
    for (int u : order) Place(u, GreedyNode(u, /*by_tokens=*/false));
    max_load_ = std::max(max_load_, *std::max_element(node_load_.begin(), node_load_.end()));
  }

  // Passes over the units: for each, the best move of it to another node or swap of it with a
  // unit of another node that lowers the distinct nodes summed over the tokens, applied at once;
  // until a pass changes nothing, or 20 passes.
  void Refine() {
    const int units = static_cast<int>(load_.size());
    for (int pass = 0; pass < 20; ++pass) {
      bool changed = false;
      for (int u = 0; u < units; ++u) {
        const int a = node_of_[static_cast<size_t>(u)];
        int best_gain = 0, bv = -1, bn = -1;
        for (int n = 0; n < nodes_; ++n) {
          if (n == a || !Fits(u, n, -1)) continue;
          const int g = MoveGain(u, n);
          if (g > best_gain) best_gain = g, bv = -1, bn = n;
        }
        for (int v = 0; v < units; ++v) {
          const int b = node_of_[static_cast<size_t>(v)];
          if (a == b || !Fits(u, b, v) || !Fits(v, a, u)) continue;
          const int g = SwapGain(u, v);
          if (g > best_gain) best_gain = g, bv = v, bn = b;
        }
        if (best_gain <= 0) continue;
        changed = true;
        Remove(u);
        if (bv >= 0) Remove(bv), Place(bv, a);
        Place(u, bn);
      }
      if (!changed) break;
    }
  }

  int node_of(int u) const { return node_of_[static_cast<size_t>(u)]; }

 private:
  // by_tokens: the node under the load limit that the most placed tokens of u touch (ties: the
  // lighter, then the lower); else (or where none is under the limit) the lightest node with room
  // for u's experts.
  int GreedyNode(int u, bool by_tokens) {
    int best = -1, best_touch = -1;
    for (int n = 0; by_tokens && n < nodes_; ++n) {
      if (!Fits(u, n, -1)) continue;
      int touch = 0;
      for (int t : unit_tokens_[static_cast<size_t>(u)]) touch += Count(t, n) > 0 ? 1 : 0;
      if (best < 0 || touch > best_touch ||
          (touch == best_touch &&
           node_load_[static_cast<size_t>(n)] < node_load_[static_cast<size_t>(best)])) {
        best = n, best_touch = touch;
      }
    }
    for (int n = 0; best < 0 && n < nodes_; ++n) {
      if (node_size_[static_cast<size_t>(n)] + size_[static_cast<size_t>(u)] > max_size_) continue;
      int lightest = n;
      for (int m = n + 1; m < nodes_; ++m) {
        if (node_size_[static_cast<size_t>(m)] + size_[static_cast<size_t>(u)] <= max_size_ &&
            node_load_[static_cast<size_t>(m)] < node_load_[static_cast<size_t>(lightest)]) {
          lightest = m;
        }
      }
      best = lightest;
    }
    return best >= 0 ? best : LightestBySize();
  }

  int& Count(int t, int n) {
    return count_[static_cast<size_t>(t) * static_cast<size_t>(nodes_) + static_cast<size_t>(n)];
  }

  // Whether unit u fits on node n (with unit `out` leaving n, or -1).
  bool Fits(int u, int n, int out) const {
    double l = node_load_[static_cast<size_t>(n)] + load_[static_cast<size_t>(u)];
    int s = node_size_[static_cast<size_t>(n)] + size_[static_cast<size_t>(u)];
    if (out >= 0) l -= load_[static_cast<size_t>(out)], s -= size_[static_cast<size_t>(out)];
    return s <= max_size_ && l <= max_load_;
  }

  int LightestBySize() const {
    return static_cast<int>(std::min_element(node_size_.begin(), node_size_.end()) -
                            node_size_.begin());
  }

  void Place(int u, int n) {
    node_of_[static_cast<size_t>(u)] = n;
    node_load_[static_cast<size_t>(n)] += load_[static_cast<size_t>(u)];
    node_size_[static_cast<size_t>(n)] += size_[static_cast<size_t>(u)];
    for (int t : unit_tokens_[static_cast<size_t>(u)]) ++Count(t, n);
  }

  void Remove(int u) {
    const int n = node_of_[static_cast<size_t>(u)];
    node_load_[static_cast<size_t>(n)] -= load_[static_cast<size_t>(u)];
    node_size_[static_cast<size_t>(n)] -= size_[static_cast<size_t>(u)];
    for (int t : unit_tokens_[static_cast<size_t>(u)]) --Count(t, n);
    node_of_[static_cast<size_t>(u)] = -1;
  }

  // Distinct nodes saved over the tokens by moving u to n.
  int MoveGain(int u, int n) {
    const int from = node_of_[static_cast<size_t>(u)];
    int g = 0;
    for (int t : unit_tokens_[static_cast<size_t>(u)]) {
      g += Count(t, from) == 1 ? 1 : 0;
      g -= Count(t, n) == 0 ? 1 : 0;
    }
    return g;
  }

  // Distinct nodes saved by swapping u (node a) and v (node b). A token with both keeps both
  // nodes' counts; the others as two moves.
  int SwapGain(int u, int v) {
    const int a = node_of_[static_cast<size_t>(u)], b = node_of_[static_cast<size_t>(v)];
    const auto& tu = unit_tokens_[static_cast<size_t>(u)];
    const auto& tv = unit_tokens_[static_cast<size_t>(v)];
    int g = 0;
    size_t i = 0, j = 0;  // both lists are in token order
    while (i < tu.size() || j < tv.size()) {
      if (j == tv.size() || (i < tu.size() && tu[i] < tv[j])) {  // u alone moves a -> b
        g += (Count(tu[i], a) == 1 ? 1 : 0) - (Count(tu[i], b) == 0 ? 1 : 0);
        ++i;
      } else if (i == tu.size() || tv[j] < tu[i]) {  // v alone moves b -> a
        g += (Count(tv[j], b) == 1 ? 1 : 0) - (Count(tv[j], a) == 0 ? 1 : 0);
        ++j;
      } else {  // both: each node keeps one
        ++i, ++j;
      }
    }
    return g;
  }

  std::vector<double> load_;
  std::vector<int> size_;
  std::vector<std::vector<int>> tokens_;
  int nodes_;
  double max_load_;
  int max_size_;
  std::vector<int> node_of_;
  std::vector<double> node_load_;
  std::vector<int> node_size_;
  std::vector<int> count_;                     // [token][node]: the token's units on the node
  std::vector<std::vector<int>> unit_tokens_;  // per unit: its tokens, ascending
};

// Units used by each sampled token of one layer (distinct, ascending).
std::vector<std::vector<int>> TokenUnits(const RoutingSample& sample, int layer, int group_size) {
  std::vector<std::vector<int>> out;
  if (sample.ids.empty() || sample.top_k < 1) return out;
  const auto& ids = sample.ids[static_cast<size_t>(layer)];
  const size_t k = static_cast<size_t>(sample.top_k);
  for (size_t t = 0; t + k <= ids.size(); t += k) {
    std::vector<int> units;
    bool ok = true;
    for (size_t j = 0; j < k; ++j) {
      if (ids[t + j] < 0) ok = false;
      units.push_back(ids[t + j] / group_size);
    }
    if (!ok) continue;
    std::sort(units.begin(), units.end());
    units.erase(std::unique(units.begin(), units.end()), units.end());
    out.push_back(std::move(units));
  }
  return out;
}

Status CheckSample(const PlannerInput& in) {
  const RoutingSample& s = in.sample;
  if (!(in.node_slack >= 0) || !std::isfinite(in.node_slack)) {
    return Status::InvalidArgument(
        fmt::format("planner: node slack {} must be a finite number ≥ 0", in.node_slack));
  }
  if (s.ids.empty()) return Status::Ok();
  if (s.ids.size() != in.load.size() || s.top_k < 1) {
    return Status::InvalidArgument(
        fmt::format("planner: the routing sample has {} layers of top-{}; the load has {} layers",
                    s.ids.size(), s.top_k, in.load.size()));
  }
  const int experts = static_cast<int>(in.load[0].size());
  for (size_t l = 0; l < s.ids.size(); ++l) {
    for (int32_t e : s.ids[l]) {
      if (e >= experts) {
        return Status::InvalidArgument(
            fmt::format("planner: the routing sample names expert {} in layer {}; there are {}", e,
                        l, experts));
      }
    }
  }
  return Status::Ok();
}

// Within one node's slots ((*phy2log)[first, first + count), `per_rank` to a rank): swaps of
// two slots of different ranks that lower the co-use of experts sharing a rank (pairs of a
// sampled token's experts on one rank), keeping both ranks' loads at most the node's max rank
// load; passes until none helps, at most 10. Co-used experts on one rank make its load per batch
// burst together; spread over the node's ranks, the node keeps the locality and its ranks the
// balance.
void SpreadCoUsed(const std::vector<double>& load, const std::vector<double>& co, int experts,
                  int first, int count, int per_rank, std::vector<int>* phy2log) {
  std::vector<int>& p2l = *phy2log;
  std::vector<int> cnt(static_cast<size_t>(experts), 0);
  for (int e : p2l) ++cnt[static_cast<size_t>(e)];
  auto w = [&](int e) { return load[static_cast<size_t>(e)] / cnt[static_cast<size_t>(e)]; };
  auto c = [&](int a, int b) {
    return co[static_cast<size_t>(a) * static_cast<size_t>(experts) + static_cast<size_t>(b)];
  };
  const int ranks = count / per_rank;
  std::vector<double> rank_load(static_cast<size_t>(ranks), 0.0);
  for (int s = 0; s < count; ++s) rank_load[static_cast<size_t>(s / per_rank)] += w(p2l[first + s]);
  // Co-use of expert e with rank r's experts other than slot `skip`.
  auto with_rank = [&](int e, int r, int skip) {
    double sum = 0;
    for (int s = r * per_rank; s < (r + 1) * per_rank; ++s) {
      if (s != skip) sum += c(e, p2l[first + s]);
    }
    return sum;
  };
  auto holds = [&](int r, int e, int skip) {
    for (int s = r * per_rank; s < (r + 1) * per_rank; ++s) {
      if (s != skip && p2l[first + s] == e) return true;
    }
    return false;
  };
  for (int pass = 0; pass < 10; ++pass) {
    bool changed = false;
    const double max_load = *std::max_element(rank_load.begin(), rank_load.end());
    for (int i = 0; i < count; ++i) {
      for (int j = 0; j < count; ++j) {
        const int a = i / per_rank, b = j / per_rank;
        if (a >= b) continue;
        const int x = p2l[first + i], y = p2l[first + j];
        if (x == y || holds(a, y, i) || holds(b, x, j)) continue;
        const double na = rank_load[static_cast<size_t>(a)] - w(x) + w(y);
        const double nb = rank_load[static_cast<size_t>(b)] - w(y) + w(x);
        if (na > max_load * (1 + 1e-12) || nb > max_load * (1 + 1e-12)) continue;
        const double gain =
            with_rank(x, a, i) + with_rank(y, b, j) - with_rank(y, a, i) - with_rank(x, b, j);
        if (gain <= 1e-9) continue;
        std::swap(p2l[first + i], p2l[first + j]);
        rank_load[static_cast<size_t>(a)] = na;
        rank_load[static_cast<size_t>(b)] = nb;
        changed = true;
      }
    }
    if (!changed) break;
  }
}

// Co-use counts of one layer's sample: co[a * experts + b], tokens that chose both a and b.
std::vector<double> CoUse(const RoutingSample& sample, int layer, int experts) {
  std::vector<double> co;
  if (sample.ids.empty() || sample.top_k < 1) return co;
  co.assign(static_cast<size_t>(experts) * static_cast<size_t>(experts), 0.0);
  const auto& ids = sample.ids[static_cast<size_t>(layer)];
  const size_t k = static_cast<size_t>(sample.top_k);
  for (size_t t = 0; t + k <= ids.size(); t += k) {
    bool ok = true;
    for (size_t j = 0; j < k; ++j) ok = ok && ids[t + j] >= 0;
    if (!ok) continue;
    for (size_t i = 0; i < k; ++i) {
      for (size_t j = 0; j < k; ++j) {
        if (i != j) {
          co[static_cast<size_t>(ids[t + i]) * static_cast<size_t>(experts) +
             static_cast<size_t>(ids[t + j])] += 1;
        }
      }
    }
  }
  return co;
}

// The plan of one layer.
Result<LayerMaps> PlanLayer(const PlannerInput& in, size_t layer) {
  const std::vector<double>& load = in.load[layer];
  const int experts = static_cast<int>(load.size());
  const bool by_group = in.num_groups > 1 && in.num_groups % in.num_nodes == 0;
  const int group_size = by_group ? experts / in.num_groups : 1;
  const int units = experts / group_size;
  std::vector<double> unit_load(static_cast<size_t>(units), 0.0);
  for (int e = 0; e < experts; ++e) unit_load[static_cast<size_t>(e / group_size)] += load[e];
  const double total = std::accumulate(load.begin(), load.end(), 0.0);
  const int slots_per_node = in.num_slots / in.num_nodes;
  const int redundant_per_node = slots_per_node - experts / in.num_nodes;
  const int max_size = by_group ? experts / in.num_nodes  // whole groups: as EPLB packs them
                                : slots_per_node - (redundant_per_node + 3) / 4;
  NodePartition part(unit_load, std::vector<int>(static_cast<size_t>(units), group_size),
                     TokenUnits(in.sample, static_cast<int>(layer), group_size), in.num_nodes,
                     total / in.num_nodes * (1 + in.node_slack) * (1 + 1e-12), max_size);
  part.Start();
  part.Refine();

  // Each node's experts and slots, planned alone; then renumbered into the layer's slots.
  const int ranks_per_node = in.num_ranks / in.num_nodes;
  std::vector<int> phy2log(static_cast<size_t>(in.num_slots), -1);
  for (int n = 0; n < in.num_nodes; ++n) {
    std::vector<int> mine;
    for (int e = 0; e < experts; ++e) {
      if (part.node_of(e / group_size) == n) mine.push_back(e);
    }
    if (mine.empty()) {
      return Status::Internal(fmt::format("planner: node {} got no expert in layer {}", n, layer));
    }
    PlannerInput sub;
    sub.load.emplace_back();
    for (int e : mine) sub.load[0].push_back(load[static_cast<size_t>(e)]);
    sub.num_slots = slots_per_node;
    sub.num_ranks = ranks_per_node;
    if (!in.rank_speed.empty()) {  // the node's ranks balanced by time among themselves
      const auto first = in.rank_speed.begin() + static_cast<std::ptrdiff_t>(n * ranks_per_node);
      sub.rank_speed.assign(first, first + static_cast<std::ptrdiff_t>(ranks_per_node));
    }
    MOERUN_ASSIGN_OR_RETURN(std::vector<LayerMaps> plan,
                            PlanPlacement(sub, PlannerPolicy::kDefault));
    for (int s = 0; s < slots_per_node; ++s) {
      phy2log[static_cast<size_t>(n * slots_per_node + s)] =
          mine[static_cast<size_t>(plan[0].phy2log[static_cast<size_t>(s)])];
    }
  }
  const std::vector<double> co = CoUse(in.sample, static_cast<int>(layer), experts);
  if (!co.empty()) {
    for (int n = 0; n < in.num_nodes; ++n) {
      SpreadCoUsed(load, co, experts, n * slots_per_node, slots_per_node,
                   in.num_slots / in.num_ranks, &phy2log);
    }
  }
  return MapsFromSlots(std::move(phy2log), experts);
}

}  // namespace

Result<std::vector<LayerMaps>> PlanNodeAware(const PlannerInput& in) {
  MOERUN_RETURN_IF_ERROR(CheckSample(in));
  if (in.num_nodes <= 1) return PlanPlacement(in, PlannerPolicy::kDefault);
  const int experts = static_cast<int>(in.load[0].size());
  if (experts % in.num_nodes != 0) {
    return Status::InvalidArgument(fmt::format(
        "planner: node-aware needs the {} nodes to divide the {} experts", in.num_nodes, experts));
  }
  std::vector<LayerMaps> plan;
  for (size_t l = 0; l < in.load.size(); ++l) {
    MOERUN_ASSIGN_OR_RETURN(LayerMaps maps, PlanLayer(in, l));
    plan.push_back(std::move(maps));
  }
  return plan;
}

double MeanNodesPerToken(const RoutingSample& sample, int layer, const LayerMaps& maps,
                         int num_ranks, int num_nodes) {
  if (sample.ids.empty() || sample.top_k < 1 || num_ranks < 1 || num_nodes < 1) return 0;
  const size_t per_rank = maps.phy2log.size() / static_cast<size_t>(num_ranks);
  const int ranks_per_node = num_ranks / num_nodes;
  const auto& ids = sample.ids[static_cast<size_t>(layer)];
  const size_t k = static_cast<size_t>(sample.top_k);
  double sum = 0;
  int64_t tokens = 0;
  for (size_t t = 0; t + k <= ids.size(); t += k) {
    std::vector<int> nodes;
    bool ok = true;
    for (size_t j = 0; j < k && ok; ++j) {
      const int e = ids[t + j];
      if (e < 0 || static_cast<size_t>(e) >= maps.log2phy.size() ||
          maps.log2phy[static_cast<size_t>(e)].empty()) {
        ok = false;
        break;
      }
      const size_t slot = static_cast<size_t>(maps.log2phy[static_cast<size_t>(e)][0]);
      nodes.push_back(static_cast<int>(slot / per_rank) / ranks_per_node);
    }
    if (!ok) continue;
    std::sort(nodes.begin(), nodes.end());
    sum += static_cast<double>(std::unique(nodes.begin(), nodes.end()) - nodes.begin());
    ++tokens;
  }
  return tokens > 0 ? sum / static_cast<double>(tokens) : 0;
}

}  // namespace moerun
