// The node-aware planner: a placement that keeps the experts one token uses on few nodes, at a
// bounded cost in balance.
//
// Where tokens come from routers on every node and a token's hidden state crosses to each other
// node that holds one of its experts (once per node, as a hierarchical dispatch sends it: one
// network copy per node, forwarded inside the node), the network carries, per token, the number
// of distinct nodes among its experts less the origin's share. With the origin spread evenly over
// N nodes, a token whose experts lie on D nodes costs D × (1 − 1/N) copies on average, so the plan
// minimises the sum of D over a sample of the routing. Counting copies per destination rank
// instead gives k × (1 − 1/N) whatever the placement: there only replicas on the origin's node
// help, which this plan does not attempt.
//
// Per layer:
//  1. Units go to nodes: the expert groups where the model routes by group (num_groups > 1 and
//     num_groups % num_nodes == 0: a token then reaches at most topk_group nodes, as in EPLB's
//     hierarchical policy), else single experts. A unit's weight is its load.
//  2. Start: units by weight, heaviest first, each to the node that the most already-placed
//     tokens of the sample touch (ties: the lighter node, then the lower), among the nodes with
//     room: a node's load may not pass (1 + node_slack) × the mean node load, and its experts may
//     not pass its slots less a quarter of its redundant slots (so hot experts can still be
//     replicated inside it). If that leaves a node over the load limit (a unit found no node with
//     room), the start is a balanced packing instead (each unit, heaviest first, to the lightest
//     node with room for its experts), and the limit is raised to that packing's heaviest node.
//  3. Refine: passes over the units; for each, the move of it to another node, or its swap with
//     a unit of another node, that most lowers the sum of D over the sample, keeping both limits,
//     applied at once; until a pass changes nothing, or 20 passes. The gain of a move is exact
//     (per sampled token, whether the old node loses it and the new one gains it), O(tokens of
//     the unit); a pass is O(units² × tokens per unit).
//  4. Within each node: its experts and its ranks' slots planned by PlanPlacement(kDefault) on
//     the node's loads alone (replicas stay inside the node); then swaps of two slots of the
//     node's ranks that lower the co-use of experts sharing a rank (pairs of a sampled token's
//     experts on one rank), never raising the node's max rank load: co-used experts on one rank
//     would make its load per batch burst together.
//  With no sample (window counts only), step 3 has nothing to gain and the plan is a balanced
//  packing of the units onto the nodes, then step 4.
//
// node_slack is the knob that trades balance for locality: 0 keeps every node at the mean as
// closely as whole units allow (the plan's balance then is about that of EPLB's hierarchical
// policy with our planner inside each node); larger values let co-used experts share a node.
#pragma once

#include <cstdint>
#include <vector>

#include "base/status.h"
#include "router/planner.h"

namespace moerun {

// The plan of every layer of `input` by its sample and node_slack: PlanPlacement(kNodeAware)
// calls this after its own checks of the input; this one checks the rest (the sample's layers
// match the load's, ids within the experts, node_slack ≥ 0, the nodes divide the experts).
// num_nodes = 1 gives kDefault's plan.
Result<std::vector<LayerMaps>> PlanNodeAware(const PlannerInput& input);

// The mean number of distinct nodes among each sampled token's experts under `maps` (slot s on
// node (s / slots per rank) / ranks per node); 0 for an empty sample. Layer `layer` of the sample.
double MeanNodesPerToken(const RoutingSample& sample, int layer, const LayerMaps& maps,
                         int num_ranks, int num_nodes);

}  // namespace moerun
