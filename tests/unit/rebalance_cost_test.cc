// What a rebalance costs (router/rebalance_cost.h) and the planner within a byte budget
// (router/placement_plan.h, PlanOptions::max_bytes).
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "router/placement_plan.h"
#include "router/rebalance_cost.h"

namespace moerun {
namespace {

Placement Table(const std::string& layers, int routers = 1, int ranks = 3, int experts = 4) {
  auto p = Placement::FromJson(
      "{\"format\": \"moerun-placement-v1\", \"version\": 1, "
      "\"num_experts\": " +
          std::to_string(experts) + ", \"num_ranks\": " + std::to_string(ranks) +
          ", \"num_routers\": " + std::to_string(routers) + ", \"layers\": {" + layers + "}}",
      "test");
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return *p;
}

TEST(RebalanceCostTest, CountsLoadsReleasesStepsAndMessages) {
  // Layer 0: experts 1 and 2 trade ranks; layer 1 unchanged; layer 2: the same experts on each
  // rank in another slot order (a step without a copy moved).
  const Placement from = Table(
      "\"0\": [[1,0],[1,1],[2,2],[2,3]], \"1\": [[1,0],[1,1],[2,2],[2,3]], "
      "\"2\": [[1,0],[1,1],[2,2],[2,3]]");
  const Placement to = Table(
      "\"0\": [[1,0],[1,2],[2,1],[2,3]], \"1\": [[1,0],[1,1],[2,2],[2,3]], "
      "\"2\": [[1,1],[1,0],[2,2],[2,3]]");
  const RebalanceCost c = CostOfRebalance(from, to, {2, 0, 1}, {1000});
  ASSERT_EQ(c.steps.size(), 2u);  // layers 0 and 2, in order
  EXPECT_EQ(c.steps[0].layer, 0);
  EXPECT_EQ(c.steps[1].layer, 2);
  const LayerCost& l0 = c.steps[0];
  ASSERT_EQ(l0.ranks.size(), 2u);
  EXPECT_EQ(l0.ranks[0].rank, 1);
  EXPECT_EQ(l0.ranks[0].load, std::vector<int>{2});
  EXPECT_EQ(l0.ranks[0].release, std::vector<int>{1});
  EXPECT_EQ(l0.ranks[1].load, std::vector<int>{1});
  EXPECT_EQ(l0.ranks[1].release, std::vector<int>{2});
  EXPECT_EQ(l0.load_bytes, 2000);
  EXPECT_EQ(l0.max_rank_load_bytes, 1000);
  EXPECT_EQ(l0.load_messages, 2);
  EXPECT_EQ(l0.release_messages, 2);
  EXPECT_EQ(l0.switch_messages, 0);  // one router: nobody else to tell
  EXPECT_TRUE(c.steps[1].ranks.empty());
  EXPECT_EQ(c.copies_loaded, 2);
  EXPECT_EQ(c.copies_released, 2);
  EXPECT_EQ(c.load_bytes, 2000);
  EXPECT_EQ(c.critical_bytes, 1000);
  EXPECT_EQ(c.max_rank_bytes, 1000);
  EXPECT_EQ(c.messages, 4);
  EXPECT_EQ(c.switch_bytes, 0);
}

TEST(RebalanceCostTest, OtherRoutersAreToldOfEverySwitch) {
  const Placement from = Table("\"*\": [[2,0],[2,1],[3,2],[3,3]]", 2, 4);
  const Placement to = Table("\"*\": [[2,0],[3,1],[3,2],[2,3]]", 2, 4);
  const RebalanceCost c = CostOfRebalance(from, to, {0, 1}, {10});
  ASSERT_EQ(c.steps.size(), 2u);  // both layers use the "*" entry
  EXPECT_EQ(c.steps[0].switch_messages, 1);
  EXPECT_EQ(c.messages, 2 * (2 + 2 + 1));
  EXPECT_EQ(c.switch_bytes, 2 * static_cast<int64_t>(to.ToJson().size()));
  EXPECT_EQ(c.max_rank_bytes, 2 * 10);  // each rank loads one expert per layer
}

TEST(RebalanceCostTest, TheSamePlacementCostsNothingAndAnotherJobIsRefusedAsNothing) {
  const Placement p = Table("\"0\": [[1,0],[1,1],[2,2],[2,3]]");
  const RebalanceCost same = CostOfRebalance(p, p, {0}, {5});
  EXPECT_TRUE(same.steps.empty());
  EXPECT_EQ(same.messages, 0);
  const Placement other = Table("\"0\": [[1,0],[2,1],[3,2],[3,3]]", 1, 4);
  EXPECT_TRUE(CostOfRebalance(p, other, {0}, {5}).steps.empty());
}

TEST(RebalanceCostTest, ThePlanWithinAByteBudget) {
  // 16 experts on 4 expert ranks, two layers: layer 0 skewed (planning helps a lot), layer 1
  // nearly even (little to gain).
  auto current = Placement::Linear(16, 5, 1);
  ASSERT_TRUE(current.ok());
  std::map<int, std::vector<double>> loads;
  loads[0].assign(16, 1.0);
  for (int e = 0; e < 4; ++e) loads[0][static_cast<size_t>(e)] = 40.0;
  loads[1].assign(16, 10.0);
  loads[1][0] = 12.0;
  const int64_t expert_bytes = 1 << 20;
  PlanOptions o;
  auto free = MakePlan(loads, *current, expert_bytes, o);
  ASSERT_TRUE(free.ok()) << free.status().ToString();
  ASSERT_GT(free->cost.load_bytes, 0);
  EXPECT_EQ(free->cost.load_bytes, free->layers[0].bytes_to_move + free->layers[1].bytes_to_move);

  // A budget of layer 0's bytes: layer 0 moves (it gains most per byte), layer 1 stays.
  o.max_bytes = free->layers[0].bytes_to_move;
  auto bounded = MakePlan(loads, *current, expert_bytes, o);
  ASSERT_TRUE(bounded.ok()) << bounded.status().ToString();
  EXPECT_LE(bounded->cost.load_bytes, o.max_bytes);
  EXPECT_FALSE(bounded->layers[0].kept);
  EXPECT_DOUBLE_EQ(bounded->layers[0].balancedness_after, free->layers[0].balancedness_after);
  if (free->layers[1].bytes_to_move > 0) {
    EXPECT_TRUE(bounded->layers[1].kept);
    EXPECT_EQ(bounded->layers[1].experts_to_load, 0);
    EXPECT_DOUBLE_EQ(bounded->layers[1].balancedness_after, bounded->layers[1].balancedness_before);
  }
  auto table = Placement::FromJson(bounded->placement_json, "plan");
  ASSERT_TRUE(table.ok());
  EXPECT_TRUE(Placement::SameSlots(*table->Layer(1), *current->Layer(1)) ||
              !bounded->layers[1].kept);

  // A budget below one expert: nothing moves.
  o.max_bytes = expert_bytes - 1;
  auto none = MakePlan(loads, *current, expert_bytes, o);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->cost.load_bytes, 0);
  EXPECT_TRUE(none->layers[0].kept);

  // Incremental within the budget: every layer's moves capped.
  o.incremental = true;
  o.max_bytes = 2 * expert_bytes;
  auto inc = MakePlan(loads, *current, expert_bytes, o);
  ASSERT_TRUE(inc.ok()) << inc.status().ToString();
  EXPECT_LE(inc->cost.load_bytes, o.max_bytes);

  // Refusals: a budget without the expert's bytes, with dead ranks, negative.
  o.incremental = false;
  EXPECT_FALSE(MakePlan(loads, *current, 0, o).ok());
  o.exclude = {2};
  EXPECT_FALSE(MakePlan(loads, *current, expert_bytes, o).ok());
  o.exclude.clear();
  o.max_bytes = -1;
  EXPECT_FALSE(MakePlan(loads, *current, expert_bytes, o).ok());
}

}  // namespace
}  // namespace moerun
