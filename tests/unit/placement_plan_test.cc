// `moectl placement plan`'s report (router/placement_plan.h): predicted balancedness before and
// after, copies and bytes to load, the planned table, and clear errors.
#include "router/placement_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace moerun {
namespace {

TEST(PlacementPlanTest, SkewedLoadOnALinearPlacement) {
  // 8 experts on 4 expert ranks (linear: experts 0,1 on rank 1, ...); experts 0 and 1 are hot.
  auto current = Placement::Linear(8, 5, 1);
  ASSERT_TRUE(current.ok());
  const std::map<int, std::vector<double>> loads = {{0, {400, 300, 10, 10, 10, 10, 10, 10}}};
  // Before: rank loads 700, 20, 20, 20 -> mean 190 / max 700.
  EXPECT_NEAR(PlacementBalancedness(loads.at(0), *current->Layer(0), 1), 190.0 / 700.0, 1e-12);
  PlanOptions o;
  o.redundant = 4;  // 12 slots, 3 per rank
  auto rep = MakePlan(loads, *current, 1000, o);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  ASSERT_EQ(rep->layers.size(), 1u);
  const LayerPlanReport& l = rep->layers[0];
  EXPECT_EQ(l.load, 760u);
  EXPECT_NEAR(l.balancedness_before, 190.0 / 700.0, 1e-12);
  // At best 0.89 here: 3 slots per rank cannot split two hot experts finer (by hand: e0 and e1
  // twice each and two small experts doubled give 190 / 220 = 0.86).
  EXPECT_GT(l.balancedness_after, 0.85);
  EXPECT_GT(l.experts_to_load, 0);
  EXPECT_EQ(l.bytes_to_move, l.experts_to_load * int64_t{1000});
  EXPECT_EQ(rep->slots_per_rank, 3);
  // The per-rank loads the balancedness figures summarize (moectl placement plan --plot).
  EXPECT_EQ(l.ranks, (std::vector<int>{1, 2, 3, 4}));
  EXPECT_EQ(l.rank_load_before, (std::vector<double>{700, 20, 20, 20}));
  ASSERT_EQ(l.rank_load_after.size(), 4u);
  double total = 0, most = 0;
  for (double v : l.rank_load_after) total += v, most = std::max(most, v);
  EXPECT_NEAR(total, 760, 1e-9);
  EXPECT_NEAR(total / 4 / most, l.balancedness_after, 1e-12);
  // The planned table is valid, one version up, and every expert has a slot.
  auto planned = Placement::FromJson(rep->placement_json, "test");
  ASSERT_TRUE(planned.ok()) << planned.status().ToString();
  EXPECT_EQ(planned->version(), current->version() + 1);
  EXPECT_TRUE(planned->CheckFits(5, 1, 8).ok());
  EXPECT_NEAR(PlacementBalancedness(loads.at(0), *planned->Layer(0), 1), l.balancedness_after,
              1e-9);
  // Planning the planned placement again moves nothing new where nothing changed.
  auto again = MakePlan(loads, *planned, 1000, o);
  ASSERT_TRUE(again.ok());
  EXPECT_NEAR(again->layers[0].balancedness_before, l.balancedness_after, 1e-9);
}

// After a death: the plan spreads the slots over the live expert ranks, none on the dead one,
// and its "before" is over the live ranks too.
TEST(PlacementPlanTest, DeadRanksAreLeftOut) {
  // 6 experts, expert ranks 1..3; rank 2 died and its experts 2, 3 were re-placed on 1 and 3.
  auto current = Placement::FromJson(
      R"({"format": "moerun-placement-v1", "version": 3, "num_experts": 6, "num_ranks": 4,
          "num_routers": 1, "layers": {"0": [[1,0],[1,1],[1,2],[3,3],[3,4],[3,5]]}})",
      "test");
  ASSERT_TRUE(current.ok()) << current.status().ToString();
  const std::map<int, std::vector<double>> loads = {{0, {300, 10, 10, 10, 10, 10}}};
  PlanOptions o;
  o.exclude = {2};
  auto rep = MakePlan(loads, *current, 0, o);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_EQ(rep->slots_per_rank, 3);  // 6 slots over 2 live ranks
  EXPECT_NEAR(rep->layers[0].balancedness_before, (350.0 / 2) / 320.0, 1e-12);
  EXPECT_EQ(rep->layers[0].ranks, (std::vector<int>{1, 3}));
  EXPECT_EQ(rep->layers[0].rank_load_before, (std::vector<double>{320, 30}));
  ASSERT_EQ(rep->layers[0].rank_load_after.size(), 2u);
  EXPECT_NEAR(rep->layers[0].rank_load_after[0] + rep->layers[0].rank_load_after[1], 350, 1e-9);
  auto planned = Placement::FromJson(rep->placement_json, "test");
  ASSERT_TRUE(planned.ok()) << planned.status().ToString();
  EXPECT_TRUE(planned->Layer(0)->rank_slots[2].empty());
  EXPECT_EQ(planned->Layer(0)->rank_slots[1].size() + planned->Layer(0)->rank_slots[3].size(), 6u);
  EXPECT_NEAR(PlacementBalancedness(loads.at(0), *planned->Layer(0), 1, o.exclude),
              rep->layers[0].balancedness_after, 1e-9);
  // Copies to load are counted against what the live ranks hold.
  int to_load = 0;
  for (int r : {1, 3}) {
    for (int sl : planned->Layer(0)->rank_slots[static_cast<size_t>(r)]) {
      const int e = planned->Layer(0)->slots[static_cast<size_t>(sl)].expert;
      bool held = false;
      for (int c : current->Layer(0)->rank_slots[static_cast<size_t>(r)]) {
        held = held || current->Layer(0)->slots[static_cast<size_t>(c)].expert == e;
      }
      to_load += held ? 0 : 1;
    }
  }
  EXPECT_EQ(rep->layers[0].experts_to_load, to_load);
  // Uneven over the live ranks: planned (the default policy takes any count), nothing on the
  // dead rank; a policy that needs even counts says why; no live rank at all: an error.
  o.redundant = 1;
  auto uneven = MakePlan(loads, *current, 0, o);
  ASSERT_TRUE(uneven.ok()) << uneven.status().ToString();
  EXPECT_EQ(uneven->slots_per_rank, uneven->min_slots_per_rank + 1);
  auto uneven_table = Placement::FromJson(uneven->placement_json, "plan");
  ASSERT_TRUE(uneven_table.ok()) << uneven_table.status().ToString();
  EXPECT_TRUE(uneven_table->Layer(0)->rank_slots[2].empty());
  o.policy = PlannerPolicy::kEplbHierarchical;
  auto refused = MakePlan(loads, *current, 0, o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("2 expert ranks (rank(s) 2 left out: dead)"),
            std::string::npos)
      << refused.status().ToString();
  o.policy = PlannerPolicy::kDefault;
  o.redundant = 0;
  o.exclude = {1, 2, 3};
  EXPECT_FALSE(MakePlan(loads, *current, 0, o).ok());
}

TEST(PlacementPlanTest, ClearErrors) {
  auto current = Placement::Linear(8, 4, 1);  // 3 expert ranks
  ASSERT_TRUE(current.ok());
  PlanOptions o;
  // 8 slots over 3 ranks: 3, 3 and 2 for the default policy; node-aware needs even counts.
  auto uneven = MakePlan({{0, std::vector<double>(8, 1.0)}}, *current, 0, o);
  ASSERT_TRUE(uneven.ok()) << uneven.status().ToString();
  EXPECT_EQ(uneven->slots_per_rank, 3);
  EXPECT_EQ(uneven->min_slots_per_rank, 2);
  o.policy = PlannerPolicy::kNodeAware;
  auto refused = MakePlan({{0, std::vector<double>(8, 1.0)}}, *current, 0, o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("use --redundant 1"), std::string::npos)
      << refused.status().ToString();
  o.policy = PlannerPolicy::kDefault;
  o.redundant = 1;
  EXPECT_FALSE(MakePlan({{0, std::vector<double>(8, 0.0)}}, *current, 0, o).ok());  // no load
  EXPECT_FALSE(MakePlan({{0, std::vector<double>(7, 1.0)}}, *current, 0, o).ok());  // wrong size
  EXPECT_FALSE(MakePlan({}, *current, 0, o).ok());
  o.redundant = -1;
  EXPECT_FALSE(MakePlan({{0, std::vector<double>(8, 1.0)}}, *current, 0, o).ok());
}

}  // namespace
}  // namespace moerun

namespace moerun {
namespace {

// The job's nodes (PlanOptions::rank_node, nodes = 0): ranks 1 and 3 on node 0 with the router,
// ranks 2 and 4 on node 1 (interleaved, as `mpirun --map-by node` puts them). A node-local plan
// puts the hot experts on both nodes, by the ranks' real nodes.
TEST(PlacementPlanTest, TheJobsNodesPlanByTheRanksRealNodes) {
  auto current = Placement::Linear(8, 5, 1);
  ASSERT_TRUE(current.ok());
  const std::map<int, std::vector<double>> loads = {{0, {900, 800, 10, 10, 10, 10, 10, 10}}};
  PlanOptions o;
  o.redundant = 4;  // 12 slots, 3 a rank
  o.policy = PlannerPolicy::kNodeLocal;
  o.nodes = 0;
  o.rank_node = {0, 0, 1, 0, 1};
  auto rep = MakePlan(loads, *current, 0, o);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  auto planned = Placement::FromJson(rep->placement_json, "plan");
  ASSERT_TRUE(planned.ok()) << planned.status().ToString();
  const LayerPlacement& lp = *planned->Layer(0);
  for (int hot : {0, 1}) {
    std::set<int> nodes;
    for (int s : lp.replicas[static_cast<size_t>(hot)]) {
      nodes.insert(o.rank_node[static_cast<size_t>(lp.slots[static_cast<size_t>(s)].rank)]);
    }
    EXPECT_EQ(nodes, (std::set<int>{0, 1})) << "expert " << hot;
  }
  // Unevenly spread (3 expert ranks on node 0, 1 on node 1): node-local is refused, the default
  // policy plans with one node.
  o.rank_node = {0, 0, 0, 0, 1};
  auto uneven = MakePlan(loads, *current, 0, o);
  ASSERT_FALSE(uneven.ok());
  EXPECT_NE(uneven.status().message().find("same number of live expert ranks"), std::string::npos)
      << uneven.status().ToString();
  o.policy = PlannerPolicy::kDefault;
  EXPECT_TRUE(MakePlan(loads, *current, 0, o).ok());
  // Unknown nodes: one node.
  o.policy = PlannerPolicy::kNodeLocal;
  o.rank_node = {0, -1, 0, 1, 1};
  EXPECT_TRUE(MakePlan(loads, *current, 0, o).ok());
}

}  // namespace
}  // namespace moerun

namespace moerun {
namespace {

// --rank-slots: named ranks hold their counts, the others share the rest; bad counts refused.
TEST(PlacementPlanTest, GivenRankSlots) {
  auto current = Placement::Linear(8, 5, 1);  // 4 expert ranks
  ASSERT_TRUE(current.ok());
  const std::map<int, std::vector<double>> loads = {{0, {90, 80, 10, 10, 10, 10, 10, 10}}};
  PlanOptions o;
  o.redundant = 2;          // 10 slots
  o.rank_slots = {{2, 1}};  // rank 2: one slot; ranks 1, 3, 4 share 9
  auto rep = MakePlan(loads, *current, 0, o);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  auto table = Placement::FromJson(rep->placement_json, "plan");
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  const LayerPlacement& lp = *table->Layer(0);
  EXPECT_EQ(lp.rank_slots[2].size(), 1u);
  for (int r : {1, 3, 4}) EXPECT_EQ(lp.rank_slots[static_cast<size_t>(r)].size(), 3u) << r;
  for (const auto& bad : std::vector<std::map<int, int>>{
           {{2, 9}},                             // more than the 8 experts
           {{0, 2}},                             // a router
           {{7, 2}},                             // no such rank
           {{1, 4}, {2, 4}, {3, 4}},             // 12 > 10 slots
           {{1, 2}, {2, 2}, {3, 2}, {4, 2}}}) {  // 8 < 10, no rank left to take the rest
    o.rank_slots = bad;
    auto r = MakePlan(loads, *current, 0, o);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("rank-slots"), std::string::npos) << r.status().ToString();
  }
  o.rank_slots = {{2, 1}};
  o.incremental = true;
  EXPECT_FALSE(MakePlan(loads, *current, 0, o).ok());
  // The incremental mode from that uneven placement, its 10 slots (2 redundant) kept.
  o.rank_slots.clear();
  auto from_uneven = MakePlan(loads, *table, 0, o);
  ASSERT_TRUE(from_uneven.ok()) << from_uneven.status().ToString();
  auto next = Placement::FromJson(from_uneven->placement_json, "plan");
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->Layer(0)->slots.size(), 10u);
  EXPECT_EQ(next->Layer(0)->rank_slots[2].size(), 1u);
  o.incremental = false;
  o.policy = PlannerPolicy::kNodeLocal;
  EXPECT_FALSE(MakePlan(loads, *current, 0, o).ok());
}

// Speeds named by rank number: the report's balancedness is in time, the plan balances it, and
// bad speeds or ranks are refused with the rank's number.
TEST(PlacementPlanTest, RankSpeedsBalanceTime) {
  auto current = Placement::Linear(16, 3, 1);  // experts 0-7 on rank 1, 8-15 on rank 2
  ASSERT_TRUE(current.ok());
  const std::map<int, std::vector<double>> loads = {{0, std::vector<double>(16, 50.0)}};
  PlanOptions o;
  o.rank_speed = {{2, 3.0}};  // rank 1: 1 (not named)
  auto rep = MakePlan(loads, *current, 1000, o);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_EQ(rep->rank_speed, (std::map<int, double>{{1, 1.0}, {2, 3.0}}));
  const LayerPlanReport& l = rep->layers[0];
  // Now: 400 rows each; times 400 (slow) and 133; a perfect split's time 800 / 4 = 200.
  EXPECT_NEAR(l.balancedness_before, 0.5, 1e-12);
  EXPECT_NEAR(l.balancedness_after, 1.0, 1e-12);  // 4 and 12 experts
  EXPECT_EQ(rep->min_slots_per_rank, 4);
  EXPECT_EQ(rep->slots_per_rank, 12);
  auto planned = Placement::FromJson(rep->placement_json, "plan");
  ASSERT_TRUE(planned.ok()) << planned.status().ToString();
  EXPECT_EQ(planned->Layer(0)->rank_slots[1].size(), 4u);
  EXPECT_EQ(planned->Layer(0)->rank_slots[2].size(), 12u);
  // Given counts keep their counts.
  o.rank_slots = {{1, 8}, {2, 8}};
  auto kept = MakePlan(loads, *current, 1000, o);
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  EXPECT_EQ(kept->slots_per_rank, 8);
  EXPECT_EQ(kept->min_slots_per_rank, 8);
  o.rank_slots.clear();
  for (const auto& [speeds, what] : std::vector<std::pair<std::map<int, double>, std::string>>{
           {{{0, 1.0}}, "names rank 0, which is not a live expert rank"},
           {{{2, 0.0}}, "rank 2 has speed 0"},
           {{{1, std::nan("")}}, "rank 1 has speed nan"}}) {
    o.rank_speed = speeds;
    auto bad = MakePlan(loads, *current, 1000, o);
    ASSERT_FALSE(bad.ok()) << what;
    EXPECT_NE(bad.status().message().find(what), std::string::npos) << bad.status().message();
  }
  o.rank_speed = {{2, 3.0}};
  o.policy = PlannerPolicy::kEplbGlobal;
  EXPECT_FALSE(MakePlan(loads, *current, 1000, o).ok());
}

// What each rank's memory holds (rank_capacity): a rank whose even share does not fit gets what
// fits, the others share the rest as evenly as counts allow; more than all hold, or --rank-slots
// above a rank's memory: refused.
TEST(PlacementPlanTest, RankMemoryCapsItsSlots) {
  auto current = Placement::Linear(16, 5, 1);  // 4 expert ranks of 4 experts each
  ASSERT_TRUE(current.ok());
  const std::map<int, std::vector<double>> loads = {
      {0, {90, 80, 70, 60, 50, 40, 30, 20, 10, 9, 8, 7, 6, 5, 4, 3}}};
  PlanOptions o;
  o.redundant = 2;             // 18 slots: 5, 5, 4, 4 evenly
  o.rank_capacity = {{4, 2}};  // rank 4 holds 2
  auto rep = MakePlan(loads, *current, 1000, o);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  auto planned = Placement::FromJson(rep->placement_json, "plan");
  ASSERT_TRUE(planned.ok()) << planned.status().ToString();
  std::vector<size_t> held;
  for (int r = 1; r <= 4; ++r)
    held.push_back(planned->Layer(0)->rank_slots[static_cast<size_t>(r)].size());
  EXPECT_EQ(held, (std::vector<size_t>{6, 5, 5, 2}));  // the 16 left over 3: the first one more
  // A capacity the even share fits changes nothing.
  o.rank_capacity = {{4, 5}};
  auto even = MakePlan(loads, *current, 1000, o);
  ASSERT_TRUE(even.ok()) << even.status().ToString();
  EXPECT_EQ(even->slots_per_rank, 5);
  EXPECT_EQ(even->min_slots_per_rank, 4);
  // More than all of them hold: refused, saying what they hold.
  o.redundant = 40;  // 56 slots; 16 + 16 + 16 + 2 = 50 fit
  o.rank_capacity = {{4, 2}};
  auto over = MakePlan(loads, *current, 1000, o);
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("hold 50"), std::string::npos) << over.status().message();
  EXPECT_NE(over.status().message().find("rank 4: 2"), std::string::npos);
  // --rank-slots above a rank's memory.
  o.redundant = 2;
  o.rank_slots = {{4, 3}};
  auto named = MakePlan(loads, *current, 1000, o);
  ASSERT_FALSE(named.ok());
  EXPECT_NE(named.status().message().find("its memory holds 2"), std::string::npos)
      << named.status().message();
  // A rank whose memory holds no expert gets none.
  o.rank_slots.clear();
  o.rank_capacity = {{4, 0}};
  auto none = MakePlan(loads, *current, 1000, o);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  auto none_table = Placement::FromJson(none->placement_json, "plan");
  ASSERT_TRUE(none_table.ok());
  EXPECT_TRUE(none_table->Layer(0)->rank_slots[4].empty());
}

}  // namespace
}  // namespace moerun
