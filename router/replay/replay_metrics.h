// What a placement makes of recorded routing (routing_trace.h): pure functions over a trace, a
// plan (router/planner.h: one LayerMaps per layer index of the trace) and a topology.
//
//  - Window balancedness: per layer PredictedBalancedness on the trace's counts (each expert's
//    load split evenly over its replicas; mean ÷ max of the ranks' loads); overall the mean and
//    the min over layers.
//  - Per batch (token-level traces only): each stream's tokens are cut into consecutive batches
//    of B tokens; a last partial batch (fewer than B tokens) is left out and counted in
//    tokens_left_out, so every figure is about batches of exactly B tokens (a stream shorter
//    than B gives no batch). A batch's tokens are split contiguously over the routers
//    (routers_per_node × nodes; router i takes tokens [i·n/R, (i+1)·n/R) and sits on node
//    i / routers_per_node); each router builds the runtime's own DispatchPlan
//    (router/dispatch_plan.h: each assignment to the replica on the least loaded rank) for its
//    tokens, starting from zero load, as the runtime starts each batch from its in-flight rows
//    (with topo.spill >= 0, the plan that prefers the router's own node: DispatchLocality).
//    A token whose record of the layer is missing (an id -1) is left out of that layer.
//    Per (layer, batch): rank loads = rows per rank summed over the routers; imbalance =
//    (max − mean) ÷ mean over the expert ranks (0 = perfect, R − 1 = one rank takes all); the
//    largest number of distinct logical experts a rank computes. Over all tokens: the share of
//    token copies sent to another node, counted three ways: per row (one per (token, k): what
//    moerun's transport sends today), per (token, destination rank) (a transport that sends a
//    token once per rank), per (token, destination node) (a hierarchical dispatch like DeepEP's
//    internode kernels: one copy per remote node, spread inside the node); and the mean number of
//    distinct nodes per token.
//  - Plan on part, judge on the rest: SplitTrace cuts a token-level trace in two.
//
// Expert rank r sits on node r / (num_ranks / num_nodes) (nodes split the ranks evenly, in
// order); slot s of a plan sits on rank s / (slots / num_ranks), as the planner says.
#pragma once

#include <cstdint>
#include <vector>

#include "base/status.h"
#include "router/placement.h"
#include "router/planner.h"
#include "router/replay/routing_trace.h"

namespace moerun {

struct ReplayTopology {
  int num_ranks = 1;         // expert ranks
  int num_nodes = 1;         // divides num_ranks
  int routers_per_node = 1;  // >= 1
  // The routers' replica choice: < 0 the plain one (least loaded rank); >= 0 the runtime's
  // preference for the router's own node with this bound (router/dispatch_plan.h,
  // DispatchLocality::spill).
  double spill = -1;
};

// InvalidArgument for ranks < 1, nodes < 1 or not dividing the ranks, routers_per_node < 1.
Status CheckTopology(const ReplayTopology& topo);

// The runtime's placement of one layer's maps, expert ranks numbered from 0 (no router ranks).
// Unlike ToLayerPlacement it accepts an expert held twice by one rank (EPLB's plans may, and
// EPLB's own runtime then serves both slots): the replica choice is the same, the two slots
// share their rank's load. InvalidArgument for inconsistent maps (slots not a multiple of the
// ranks, an expert out of range or with no slot).
Result<LayerPlacement> ReplayPlacement(const LayerMaps& maps, int num_experts, int num_ranks);

struct WindowBalance {
  std::vector<double> per_layer;
  double mean = 1.0;
  double min = 1.0;
};

// InvalidArgument when the plan does not have one LayerMaps per layer of the trace, or a layer's
// maps do not fit the trace's experts.
Result<WindowBalance> WindowBalancedness(const RoutingTrace& trace,
                                         const std::vector<LayerMaps>& plan, int num_ranks);

struct BatchMetrics {
  int64_t batch_tokens = 0;
  int64_t batches = 0;          // (layer, batch) pairs judged
  int64_t tokens_judged = 0;    // per layer: tokens in full batches (summed over streams)
  int64_t tokens_left_out = 0;  // per layer: tokens of the last partial batches
  // (max − mean) ÷ mean of the rank loads, over the (layer, batch) pairs.
  double imbalance_mean = 0, imbalance_p50 = 0, imbalance_p95 = 0, imbalance_max = 0;
  // Per (layer, batch): the most distinct experts one rank computes; mean and max over pairs.
  double max_rank_experts_mean = 0, max_rank_experts_max = 0;
  // Shares of token copies that leave their router's node (0 with one node).
  double off_node_share_rows = 0;        // rows (token, k)
  double off_node_share_token_rank = 0;  // (token, destination rank) pairs
  double off_node_share_token_node = 0;  // (token, destination node) pairs
  double nodes_per_token = 0;            // distinct destination nodes per token
  // (token, destination node) pairs off the token's node, per token: the network copies of a
  // hierarchical dispatch (one per remote node).
  double off_node_copies_per_token = 0;
};

// Percentile of `v` (q in [0, 1]): the value at rank ceil(q · n) of the sorted values (the
// nearest-rank definition; p50 of {1, 2, 3, 4} is 2, max is q = 1). 0 for an empty vector.
double NearestRankPercentile(std::vector<double> v, double q);

// InvalidArgument for a trace without tokens, a bad topology, batch_tokens < 1, or a plan that
// does not fit. A trace with no full batch gives batches = 0 and zeros.
Result<BatchMetrics> MeasureBatches(const RoutingTrace& trace, const std::vector<LayerMaps>& plan,
                                    const ReplayTopology& topo, int64_t batch_tokens);

enum class SplitBy { kTokens, kStreams };

struct TraceParts {
  RoutingTrace plan;   // what the planner sees
  RoutingTrace judge;  // what the plan is judged on
};

// kTokens: each stream's first floor(fraction × tokens) tokens go to `plan`, the rest to `judge`;
// kStreams: the first floor(fraction × streams) streams to `plan`, the others to `judge`. Each
// part gets its own counts; a stream left with no token in a part is not in it. InvalidArgument
// for a trace without tokens, a fraction outside (0, 1), or a part left with no token.
Result<TraceParts> SplitTrace(const RoutingTrace& trace, double fraction, SplitBy by);

}  // namespace moerun
