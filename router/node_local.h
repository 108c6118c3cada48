// The node-local planner: copies of the hot experts on every node, so that a router's tokens
// find most of their experts on its own node, and a dispatch that prefers them
// (router/dispatch_plan.h, DispatchLocality) keeps those rows off the network.
//
// Where routers sit on every node and each sends a token's row to a copy of each of its experts,
// an expert held on m of the N nodes is reached without the network from m/N of the routers:
// each extra node copy of expert e saves load(e) / N rows off the node, whatever the expert, so
// the copies go to the hottest experts first, each to every node. Per layer:
//  1. Copies per node: the layer's redundant slots (slots − experts) are split: a share
//     `local_share` becomes copies on other nodes (node-level replicas), the rest stays with each
//     node for copies inside it (so that a hot expert can have two copies on one node and the
//     dispatch a choice there); none with one rank a node, and halved (to none) while a node's plan
//     would hold an expert twice on one rank. Every expert gets one node copy; then, hottest first,
//     an expert gets a copy on every node, until the node-level copies are spent (the last one may
//     get fewer than N).
//  2. Which nodes: the experts on every node go everywhere; the others, by their load per node
//     copy (load ÷ copies) heaviest first, each copy to the node of least expected load that has
//     room and does not hold it yet. A node's expected load counts each of its experts'
//     load ÷ its node copies: the routers of a node without a copy spread over the nodes with one.
//  3. Within each node: its experts with those loads, planned on its ranks' slots by
//     PlanPlacement(kDefault) (the redundant slots kept in step 1 become replicas inside the node).
// The loads used are the window's plus copy_prior × the mean expert load: 0 trusts the window (its
// hot experts get the node copies); larger values spread the copies more evenly over the experts,
// for traffic whose hot experts are not the window's (other prompts). A sample of the routing
// (PlannerInput.sample), where given, keeps experts with one copy that the same tokens use on one
// node (each to the node its already placed co-used experts are on, within (1 + node_slack) × the
// mean node load).
// Nodes are contiguous and equal (planner.h: expert rank r on node r / (ranks ÷ nodes)); the
// runtime maps its ranks' hosts onto that order (placement_plan.h). One node: kDefault's plan.
#pragma once

#include <vector>

#include "base/status.h"
#include "router/planner.h"

namespace moerun {

// The plan of every layer of `input` (PlanPlacement(kNodeLocal) calls this after its own checks);
// InvalidArgument for local_share outside [0, 1] or copy_prior not finite and >= 0.
Result<std::vector<LayerMaps>> PlanNodeLocal(const PlannerInput& input);

}  // namespace moerun
