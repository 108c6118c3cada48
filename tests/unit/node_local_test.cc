#include "router/node_local.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "router/planner.h"
#include "router/replay/replay_metrics.h"

namespace moerun {
namespace {

// The nodes that hold expert e (nodes split the ranks evenly, in order).
std::set<int> NodesHolding(const LayerMaps& m, int e, int ranks, int nodes) {
  const size_t per = m.phy2log.size() / static_cast<size_t>(ranks);
  std::set<int> out;
  for (int s : m.log2phy[static_cast<size_t>(e)]) {
    out.insert(static_cast<int>(static_cast<size_t>(s) / per) / (ranks / nodes));
  }
  return out;
}

// No expert twice on one rank; every expert placed; every slot used.
void CheckLocalTable(const LayerMaps& m, int experts, int ranks) {
  const size_t per = m.phy2log.size() / static_cast<size_t>(ranks);
  for (int r = 0; r < ranks; ++r) {
    std::set<int> here;
    for (size_t s = static_cast<size_t>(r) * per; s < (static_cast<size_t>(r) + 1) * per; ++s) {
      ASSERT_GE(m.phy2log[s], 0);
      EXPECT_TRUE(here.insert(m.phy2log[s]).second) << "expert twice on rank " << r;
    }
  }
  for (int e = 0; e < experts; ++e) EXPECT_GE(m.logcnt[static_cast<size_t>(e)], 1) << e;
}

std::vector<double> ZipfLoad(int experts, double s, std::mt19937* rng) {
  std::vector<double> load(static_cast<size_t>(experts));
  std::vector<int> order(static_cast<size_t>(experts));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), *rng);
  for (int i = 0; i < experts; ++i) {
    load[static_cast<size_t>(order[static_cast<size_t>(i)])] = 1000.0 / std::pow(i + 1, s);
  }
  return load;
}

TEST(NodeLocalTest, TheHottestExpertsGetACopyOnEveryNode) {
  std::mt19937 rng(3);
  PlannerInput in;
  in.load = {ZipfLoad(64, 1.0, &rng)};
  in.num_ranks = 16;
  in.num_nodes = 4;
  in.num_slots = 128;     // 8 a rank, 64 redundant
  in.local_share = 0.75;  // 48 node copies: the 16 hottest on all 4 nodes
  auto plan = PlanPlacement(in, PlannerPolicy::kNodeLocal);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const LayerMaps& m = (*plan)[0];
  CheckLocalTable(m, 64, 16);
  std::vector<int> order(64);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return in.load[0][a] > in.load[0][b]; });
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(NodesHolding(m, order[static_cast<size_t>(i)], 16, 4).size(), 4u) << "hot #" << i;
  }
  for (int i = 16; i < 64; ++i) {
    EXPECT_EQ(NodesHolding(m, order[static_cast<size_t>(i)], 16, 4).size(), 1u) << "cold #" << i;
  }
  // The balance stays that of a good plan (each node's routers serve their own copies).
  EXPECT_GT(PredictedBalancedness(in.load[0], m, 16), 0.9);
}

TEST(NodeLocalTest, OneNodeIsTheDefaultPlanAndBadKnobsAreRefused) {
  std::mt19937 rng(5);
  PlannerInput in;
  in.load = {ZipfLoad(32, 0.8, &rng), ZipfLoad(32, 1.2, &rng)};
  in.num_ranks = 8;
  in.num_slots = 40;
  auto a = PlanPlacement(in, PlannerPolicy::kNodeLocal);
  auto b = PlanPlacement(in, PlannerPolicy::kDefault);
  ASSERT_TRUE(a.ok() && b.ok());
  for (size_t l = 0; l < 2; ++l) EXPECT_EQ((*a)[l].phy2log, (*b)[l].phy2log);
  in.num_nodes = 2;
  in.local_share = 1.5;
  EXPECT_FALSE(PlanPlacement(in, PlannerPolicy::kNodeLocal).ok());
  in.local_share = 0.5;
  in.copy_prior = NAN;
  EXPECT_FALSE(PlanPlacement(in, PlannerPolicy::kNodeLocal).ok());
  in.copy_prior = -1;
  EXPECT_FALSE(PlanPlacement(in, PlannerPolicy::kNodeLocal).ok());
}

// Every share and prior on uneven shapes gives a table (no expert twice on a rank, all placed).
TEST(NodeLocalTest, EveryShareAndPriorGivesATable) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 40; ++trial) {
    const int nodes = 2 + static_cast<int>(rng() % 3);
    const int ranks = nodes * (1 + static_cast<int>(rng() % 4));
    const int experts = 8 + static_cast<int>(rng() % 40);
    const int per_rank = (experts + ranks - 1) / ranks + static_cast<int>(rng() % 4);
    PlannerInput in;
    in.load = {ZipfLoad(experts, 0.5 + (rng() % 10) * 0.1, &rng)};
    in.num_ranks = ranks;
    in.num_nodes = nodes;
    in.num_slots = per_rank * ranks;
    in.local_share = (rng() % 5) * 0.25;
    in.copy_prior = (rng() % 3) * 10.0;
    auto plan = PlanPlacement(in, PlannerPolicy::kNodeLocal);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString() << " trial " << trial;
    CheckLocalTable((*plan)[0], experts, ranks);
  }
}

// With copies of the hot experts on every node, a dispatch that prefers the router's node sends
// fewer rows off it than the plain choice, on the same plan.
TEST(NodeLocalTest, PreferringTheNodeCutsOffNodeRows) {
  std::mt19937 rng(9);
  const int experts = 32, k = 4;
  std::vector<double> load = ZipfLoad(experts, 1.1, &rng);
  std::discrete_distribution<int> pick(load.begin(), load.end());
  RoutingTrace trace;
  trace.num_experts = experts;
  trace.top_k = k;
  trace.source = "zipf";
  RoutingTrace::Stream s;
  s.tokens = 512;
  s.ids.resize(1);
  for (int t = 0; t < s.tokens; ++t) {
    std::set<int> chosen;
    while (static_cast<int>(chosen.size()) < k) chosen.insert(pick(rng));
    for (int e : chosen) s.ids[0].push_back(e);
  }
  trace.streams.push_back(s);
  trace.layers = {0};
  CountFromStreams(&trace);
  PlannerInput in;
  in.load = trace.counts;
  in.num_ranks = 8;
  in.num_nodes = 2;
  in.num_slots = 64;
  in.local_share = 1.0;
  auto plan = PlanPlacement(in, PlannerPolicy::kNodeLocal);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ReplayTopology topo;
  topo.num_ranks = 8;
  topo.num_nodes = 2;
  auto plain = MeasureBatches(trace, *plan, topo, 64);
  topo.spill = 1.0;
  auto local = MeasureBatches(trace, *plan, topo, 64);
  ASSERT_TRUE(plain.ok() && local.ok());
  EXPECT_LT(local->off_node_share_rows, plain->off_node_share_rows * 0.8);
  EXPECT_LT(local->off_node_copies_per_token, plain->off_node_copies_per_token);
}

}  // namespace
}  // namespace moerun
