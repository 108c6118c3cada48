#include "router/replay/replay_metrics.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "router/dispatch_plan.h"

namespace moerun {
namespace {

Status CheckPlanFits(const RoutingTrace& trace, const std::vector<LayerMaps>& plan) {
  if (plan.size() != static_cast<size_t>(trace.num_layers())) {
    return Status::InvalidArgument("the plan has " + std::to_string(plan.size()) +
                                   " layers, the trace " + std::to_string(trace.num_layers()));
  }
  return Status::Ok();
}

// Distinct values of a short list (a token's ranks or nodes), in place; returns how many.
size_t Distinct(std::vector<int>& v) {
  std::sort(v.begin(), v.end());
  return static_cast<size_t>(std::unique(v.begin(), v.end()) - v.begin());
}

}  // namespace

Status CheckTopology(const ReplayTopology& topo) {
  if (topo.num_ranks < 1) return Status::InvalidArgument("expert ranks must be >= 1");
  if (topo.num_nodes < 1 || topo.num_ranks % topo.num_nodes != 0) {
    return Status::InvalidArgument("nodes (" + std::to_string(topo.num_nodes) +
                                   ") must be >= 1 and divide the expert ranks (" +
                                   std::to_string(topo.num_ranks) + ")");
  }
  if (topo.routers_per_node < 1) return Status::InvalidArgument("routers per node must be >= 1");
  if (std::isnan(topo.spill)) return Status::InvalidArgument("spill must be a number");
  return Status::Ok();
}

Result<LayerPlacement> ReplayPlacement(const LayerMaps& maps, int num_experts, int num_ranks) {
  const size_t slots = maps.phy2log.size();
  if (num_ranks < 1 || slots == 0 || slots % static_cast<size_t>(num_ranks) != 0) {
    return Status::InvalidArgument("the plan's " + std::to_string(slots) +
                                   " slots do not divide over " + std::to_string(num_ranks) +
                                   " ranks");
  }
  const size_t per = slots / static_cast<size_t>(num_ranks);
  LayerPlacement lp;
  lp.slots.resize(slots);
  lp.replicas.resize(static_cast<size_t>(num_experts));
  lp.rank_slots.resize(static_cast<size_t>(num_ranks));
  for (size_t s = 0; s < slots; ++s) {
    const int e = maps.phy2log[s];
    if (e < 0 || e >= num_experts) {
      return Status::InvalidArgument("the plan's slot " + std::to_string(s) + " holds expert " +
                                     std::to_string(e) + "; the trace has " +
                                     std::to_string(num_experts) + " experts");
    }
    const int rank = static_cast<int>(s / per);
    lp.slots[s] = Slot{rank, e};
    lp.replicas[static_cast<size_t>(e)].push_back(static_cast<int>(s));
    lp.rank_slots[static_cast<size_t>(rank)].push_back(static_cast<int>(s));
  }
  for (int e = 0; e < num_experts; ++e) {
    if (lp.replicas[static_cast<size_t>(e)].empty()) {
      return Status::InvalidArgument("the plan gives expert " + std::to_string(e) + " no slot");
    }
  }
  return lp;
}

Result<WindowBalance> WindowBalancedness(const RoutingTrace& trace,
                                         const std::vector<LayerMaps>& plan, int num_ranks) {
  MOERUN_RETURN_IF_ERROR(CheckPlanFits(trace, plan));
  if (plan.empty()) return Status::InvalidArgument("the trace has no layer");
  WindowBalance w;
  w.mean = 0;
  for (size_t l = 0; l < plan.size(); ++l) {
    // Checks the maps against the trace (PredictedBalancedness itself trusts them).
    MOERUN_RETURN_IF_ERROR(ReplayPlacement(plan[l], trace.num_experts, num_ranks).status());
    const double b = PredictedBalancedness(trace.counts[l], plan[l], num_ranks);
    w.per_layer.push_back(b);
    w.mean += b;
    w.min = std::min(w.min, b);
  }
  w.mean /= static_cast<double>(plan.size());
  return w;
}

double NearestRankPercentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double n = static_cast<double>(v.size());
  const auto rank = static_cast<int64_t>(std::ceil(std::clamp(q, 0.0, 1.0) * n));
  return v[static_cast<size_t>(
      std::clamp<int64_t>(rank - 1, 0, static_cast<int64_t>(v.size()) - 1))];
}

// Token copies of one router's plan, and where they go.
struct Copies {
  double rows = 0, rows_off = 0, token_ranks = 0, token_ranks_off = 0, token_nodes = 0,
         token_nodes_off = 0, tokens = 0;
};

// Adds the copies of the `tokens` tokens of `dp` (a router on `node`) to *c.
void CountCopies(const DispatchPlan& dp, int64_t tokens, size_t K, int node, int ranks_per_node,
                 Copies* c) {
  std::vector<int> dest_ranks, dest_nodes;
  for (int64_t j = 0; j < tokens; ++j) {
    dest_ranks.clear();
    for (size_t k = 0; k < K; ++k) {
      const int64_t r = dp.assignment_row[static_cast<size_t>(j) * K + k];
      const auto it = std::upper_bound(dp.rank_offset.begin(), dp.rank_offset.end(), r);
      dest_ranks.push_back(static_cast<int>(it - dp.rank_offset.begin()) - 1);
    }
    for (int d : dest_ranks) {
      c->rows += 1;
      if (d / ranks_per_node != node) c->rows_off += 1;
    }
    const size_t nr = Distinct(dest_ranks);
    dest_nodes.clear();
    for (size_t x = 0; x < nr; ++x) {
      c->token_ranks += 1;
      const int dn = dest_ranks[x] / ranks_per_node;
      if (dn != node) c->token_ranks_off += 1;
      dest_nodes.push_back(dn);
    }
    const size_t nn = Distinct(dest_nodes);
    for (size_t x = 0; x < nn; ++x) {
      c->token_nodes += 1;
      if (dest_nodes[x] != node) c->token_nodes_off += 1;
    }
    c->tokens += 1;
  }
}

// The most distinct logical experts one rank computes, from the rows of each slot.
int MostExpertsOnARank(const LayerPlacement& lp, const std::vector<int64_t>& slot_rows,
                       std::vector<int64_t>* expert_stamp, int64_t* stamp) {
  int most = 0;
  for (const std::vector<int>& rank_slots : lp.rank_slots) {
    ++*stamp;
    int distinct = 0;
    for (int sl : rank_slots) {
      const size_t e = static_cast<size_t>(lp.slots[static_cast<size_t>(sl)].expert);
      if (slot_rows[static_cast<size_t>(sl)] > 0 && (*expert_stamp)[e] != *stamp) {
        (*expert_stamp)[e] = *stamp;
        ++distinct;
      }
    }
    most = std::max(most, distinct);
  }
  return most;
}

Result<BatchMetrics> MeasureBatches(const RoutingTrace& trace, const std::vector<LayerMaps>& plan,
                                    const ReplayTopology& topo, int64_t batch_tokens) {
  if (!trace.token_level()) {
    return Status::InvalidArgument(trace.source +
                                   ": window counts only; batches need a "
                                   "token-level trace");
  }
  if (batch_tokens < 1) return Status::InvalidArgument("batch tokens must be >= 1");
  if (trace.top_k < 1) return Status::InvalidArgument(trace.source + ": top_k unknown");
  MOERUN_RETURN_IF_ERROR(CheckTopology(topo));
  MOERUN_RETURN_IF_ERROR(CheckPlanFits(trace, plan));
  const int R = topo.num_ranks;
  const int E = trace.num_experts;
  const size_t K = static_cast<size_t>(trace.top_k);
  const int routers = topo.routers_per_node * topo.num_nodes;
  const int ranks_per_node = R / topo.num_nodes;

  BatchMetrics m;
  m.batch_tokens = batch_tokens;
  std::vector<double> imbalance, max_experts;
  Copies c;

  DispatchPlan dp;
  std::vector<int> rank_node(static_cast<size_t>(R));
  for (int d = 0; d < R; ++d) rank_node[static_cast<size_t>(d)] = d / ranks_per_node;
  DispatchLocality locality{rank_node, 0, topo.spill};
  std::vector<double> load(static_cast<size_t>(R));
  std::vector<int64_t> rank_rows(static_cast<size_t>(R));
  std::vector<int64_t> slot_rows;
  std::vector<int64_t> valid;
  std::vector<int32_t> ids;
  std::vector<int64_t> expert_stamp(static_cast<size_t>(E), -1);
  int64_t stamp = 0;

  for (size_t l = 0; l < plan.size(); ++l) {
    MOERUN_ASSIGN_OR_RETURN(const LayerPlacement lp, ReplayPlacement(plan[l], E, R));
    for (const auto& s : trace.streams) {
      if (l >= s.ids.size()) continue;
      const std::vector<int32_t>& layer_ids = s.ids[l];
      const int64_t full = s.tokens / batch_tokens;
      if (l == 0) {  // per layer: the same in every layer
        m.tokens_judged += full * batch_tokens;
        m.tokens_left_out += s.tokens - full * batch_tokens;
      }
      for (int64_t b = 0; b < full; ++b) {
        valid.clear();
        for (int64_t t = b * batch_tokens; t < (b + 1) * batch_tokens; ++t) {
          const int32_t* row = layer_ids.data() + static_cast<size_t>(t) * K;
          if (std::all_of(row, row + K, [E](int32_t e) { return e >= 0 && e < E; })) {
            valid.push_back(t);
          }
        }
        const auto n = static_cast<int64_t>(valid.size());
        if (n == 0) continue;
        std::fill(rank_rows.begin(), rank_rows.end(), 0);
        slot_rows.assign(lp.slots.size(), 0);
        for (int i = 0; i < routers; ++i) {
          const int64_t lo = i * n / routers, hi = (i + 1) * n / routers;
          if (lo == hi) continue;
          ids.clear();
          for (int64_t j = lo; j < hi; ++j) {
            const int32_t* row = layer_ids.data() + static_cast<size_t>(valid[j]) * K;
            ids.insert(ids.end(), row, row + K);
          }
          std::fill(load.begin(), load.end(), 0.0);
          locality.node = i / topo.routers_per_node;
          dp.Build(ids.data(), hi - lo, static_cast<int>(K), lp, load,
                   topo.spill >= 0 ? &locality : nullptr);
          for (int d = 0; d < R; ++d) rank_rows[static_cast<size_t>(d)] += dp.rows_to(d);
          for (size_t sl = 0; sl < lp.slots.size(); ++sl) slot_rows[sl] += dp.slot_rows[sl];
          CountCopies(dp, hi - lo, K, i / topo.routers_per_node, ranks_per_node, &c);
        }
        double sum = 0, max = 0;
        for (int64_t v : rank_rows) sum += static_cast<double>(v), max = std::max(max, double(v));
        const double mean = sum / R;
        imbalance.push_back(mean > 0 ? (max - mean) / mean : 0.0);
        const int most = MostExpertsOnARank(lp, slot_rows, &expert_stamp, &stamp);
        max_experts.push_back(most);
      }
    }
  }
  m.batches = static_cast<int64_t>(imbalance.size());
  if (m.batches == 0) return m;
  double isum = 0, esum = 0;
  for (double v : imbalance) isum += v;
  for (double v : max_experts) esum += v;
  m.imbalance_mean = isum / static_cast<double>(m.batches);
  m.imbalance_p50 = NearestRankPercentile(imbalance, 0.5);
  m.imbalance_p95 = NearestRankPercentile(imbalance, 0.95);
  m.imbalance_max = NearestRankPercentile(imbalance, 1.0);
  m.max_rank_experts_mean = esum / static_cast<double>(m.batches);
  m.max_rank_experts_max = *std::max_element(max_experts.begin(), max_experts.end());
  m.off_node_share_rows = c.rows > 0 ? c.rows_off / c.rows : 0;
  m.off_node_share_token_rank = c.token_ranks > 0 ? c.token_ranks_off / c.token_ranks : 0;
  m.off_node_share_token_node = c.token_nodes > 0 ? c.token_nodes_off / c.token_nodes : 0;
  m.nodes_per_token = c.tokens > 0 ? c.token_nodes / c.tokens : 0;
  m.off_node_copies_per_token = c.tokens > 0 ? c.token_nodes_off / c.tokens : 0;
  return m;
}

Result<TraceParts> SplitTrace(const RoutingTrace& trace, double fraction, SplitBy by) {
  if (!trace.token_level()) {
    return Status::InvalidArgument(trace.source +
                                   ": window counts cannot be split; only "
                                   "token-level traces");
  }
  if (!(fraction > 0 && fraction < 1)) {
    return Status::InvalidArgument("the planning fraction must be in (0, 1)");
  }
  TraceParts parts;
  for (RoutingTrace* p : {&parts.plan, &parts.judge}) {
    p->source = trace.source;
    p->num_experts = trace.num_experts;
    p->top_k = trace.top_k;
    p->layers = trace.layers;
  }
  const size_t K = static_cast<size_t>(trace.top_k);
  auto add = [](RoutingTrace* to, const RoutingTrace::Stream& s, int64_t from, int64_t end,
                size_t k) {
    if (end <= from) return;
    RoutingTrace::Stream part;
    part.name = s.name;
    part.tokens = end - from;
    for (const auto& row : s.ids) {
      part.ids.emplace_back(
          row.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(from) * k),
          row.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(end) * k));
    }
    to->streams.push_back(std::move(part));
  };
  if (by == SplitBy::kTokens) {
    for (const auto& s : trace.streams) {
      const auto cut = static_cast<int64_t>(std::floor(fraction * static_cast<double>(s.tokens)));
      add(&parts.plan, s, 0, cut, K);
      add(&parts.judge, s, cut, s.tokens, K);
    }
  } else {
    const auto cut =
        static_cast<size_t>(std::floor(fraction * static_cast<double>(trace.streams.size())));
    for (size_t i = 0; i < trace.streams.size(); ++i) {
      add(i < cut ? &parts.plan : &parts.judge, trace.streams[i], 0, trace.streams[i].tokens, K);
    }
  }
  if (parts.plan.streams.empty() || parts.judge.streams.empty()) {
    return Status::InvalidArgument(trace.source + ": a planning fraction of " +
                                   std::to_string(fraction) + " leaves one part without tokens");
  }
  CountFromStreams(&parts.plan);
  CountFromStreams(&parts.judge);
  return parts;
}

}  // namespace moerun
