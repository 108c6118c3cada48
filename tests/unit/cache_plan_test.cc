// The placement planner and the expert cache (router/cache_plan.h): the predicted hit rate, the
// refinement that keeps hot experts resident without raising the max rank load, and MakePlan's
// use of both (router/placement_plan.h).
#include "router/cache_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "router/placement_plan.h"

namespace moerun {
namespace {

LayerMaps Maps(std::vector<int> phy2log, int num_log) {
  LayerMaps m;
  m.log2phy.resize(static_cast<size_t>(num_log));
  m.logcnt.assign(static_cast<size_t>(num_log), 0);
  for (size_t s = 0; s < phy2log.size(); ++s) {
    m.log2phy[static_cast<size_t>(phy2log[s])].push_back(static_cast<int>(s));
    ++m.logcnt[static_cast<size_t>(phy2log[s])];
  }
  m.phy2log = std::move(phy2log);
  return m;
}

double MaxRankLoad(const std::vector<double>& load, const LayerPlacement& lp) {
  std::vector<double> rank(lp.rank_slots.size(), 0.0);
  for (const Slot& s : lp.slots) {
    rank[static_cast<size_t>(s.rank)] +=
        load[static_cast<size_t>(s.expert)] /
        static_cast<double>(lp.replicas[static_cast<size_t>(s.expert)].size());
  }
  return *std::max_element(rank.begin(), rank.end());
}

// The rank (of the job) that holds `expert` in `lp`'s first copy.
int RankOf(const LayerPlacement& lp, int expert) {
  return lp.slots[static_cast<size_t>(lp.replicas[static_cast<size_t>(expert)][0])].rank;
}

TEST(CachePlanTest, HitRateOfMaps) {
  // Ranks 0 {e0 10, e1 6}, 1 {e2 3, e3 1}: a 1-expert cache keeps e0 and e2.
  const std::vector<double> load = {10, 6, 3, 1};
  const LayerMaps m = Maps({0, 1, 2, 3}, 4);
  EXPECT_DOUBLE_EQ(PredictedHitRate(load, m, 2, {1, 1}), 13.0 / 20);
  EXPECT_DOUBLE_EQ(PredictedHitRate(load, m, 2, {1}), 14.0 / 20);       // rank 1: no cache
  EXPECT_DOUBLE_EQ(PredictedHitRate(load, m, 2, {1, 0}), 14.0 / 20);    // 0: no cache either
  EXPECT_DOUBLE_EQ(PredictedHitRate(load, m, 2, {2, 5}), 1.0);          // room for all
  EXPECT_DOUBLE_EQ(PredictedHitRate(load, m, 2, {}), 1.0);              // no cache
  EXPECT_DOUBLE_EQ(PredictedHitRate({0, 0, 0, 0}, m, 2, {1, 1}), 1.0);  // no load
}

TEST(CachePlanTest, HitRateWithReplicasAndTies) {
  // Expert 0 on both ranks (8 split 4 + 4): rank 0 {e0 4, e1 3}, rank 1 {e0 4, e2 2}.
  EXPECT_DOUBLE_EQ(PredictedHitRate({8, 3, 2}, Maps({0, 1, 0, 2}, 3), 2, {1, 1}), 8.0 / 13);
  // Ties: equal loads keep the lower expert; the sum is that of any B of them.
  EXPECT_DOUBLE_EQ(PredictedHitRate({5, 5, 5, 5}, Maps({1, 0, 3, 2}, 4), 2, {1, 1}), 0.5);
  // A replica tied with another expert: rank 1 {e0 4, e2 4} keeps e0 (lower), 4 either way.
  EXPECT_DOUBLE_EQ(PredictedHitRate({8, 1, 4}, Maps({0, 1, 0, 2}, 3), 2, {1, 1}), 8.0 / 13);
}

TEST(CachePlanTest, HitRateOfAPlacementLeavesExcludedRanksOut) {
  // Expert ranks 1..3; expert 0 on ranks 1 and 3 (8 split 4 + 4).
  auto p = Placement::FromJson(
      R"({"format": "moerun-placement-v1", "version": 1, "num_experts": 5, "num_ranks": 4,
          "num_routers": 1, "layers": {"0": [[1,0],[1,1],[2,2],[2,3],[3,0],[3,4]]}})",
      "test");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const LayerPlacement& lp = *p->Layer(0);
  const std::vector<double> load = {8, 2, 6, 1, 4};
  // All live: rank 1 keeps e0 (4 of 6), rank 2 e2 (6 of 7), rank 3 e0 over e4 (tie: 4 of 8).
  EXPECT_DOUBLE_EQ(PlacementHitRate(load, lp, 1, {1, 1, 1}), 14.0 / 21);
  // Rank 2 dead: left out of both sums; its budget (index 1) does not matter.
  EXPECT_DOUBLE_EQ(PlacementHitRate(load, lp, 1, {1, 1, 1}, {2}), 8.0 / 14);
  EXPECT_DOUBLE_EQ(PlacementHitRate(load, lp, 1, {1, 0, 1}, {2}), 8.0 / 14);
  EXPECT_DOUBLE_EQ(PlacementHitRate(load, lp, 1, {1}, {2}), 12.0 / 14);  // only rank 1 caches
  EXPECT_DOUBLE_EQ(PlacementHitRate(load, lp, 1, {}, {2}), 1.0);
  // The same as the maps of that placement.
  auto maps = FromLayerPlacement(lp, 1);
  ASSERT_TRUE(maps.ok());
  EXPECT_DOUBLE_EQ(PredictedHitRate(load, *maps, 3, {1, 1, 1}), 14.0 / 21);
}

// 9 experts over 3 expert ranks, 3 slots each, a 1-expert cache on every rank. The plain planner
// balances to a max rank load of 22 with the two hottest experts (0 and 6, 10 each) on one rank;
// with the caches, they go to different ranks (one swaps with expert 2, 9): the max stays 22.
const std::map<int, std::vector<double>> kHotPair = {{0, {10, 8, 9, 0, 7, 8, 10, 1, 7}}};

TEST(CachePlanTest, ImproveForCacheSeparatesHotExperts) {
  auto current = Placement::Linear(9, 4, 1);
  ASSERT_TRUE(current.ok());
  const std::vector<double>& load = kHotPair.at(0);
  PlanOptions o;
  auto plain = MakePlan(kHotPair, *current, 0, o);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  auto plain_p = Placement::FromJson(plain->placement_json, "plain");
  ASSERT_TRUE(plain_p.ok()) << plain_p.status().ToString();
  const LayerPlacement& a = *plain_p->Layer(0);
  ASSERT_EQ(RankOf(a, 0), RankOf(a, 6)) << plain->placement_json;  // the premise
  const double plain_hit = PlacementHitRate(load, a, 1, {1, 1, 1});
  EXPECT_DOUBLE_EQ(plain_hit, 27.0 / 60);
  EXPECT_DOUBLE_EQ(plain->layers[0].hit_rate_after, 1.0);  // no cache given

  o.cache_experts = {1, 1, 1};
  auto cached = MakePlan(kHotPair, *current, 0, o);
  ASSERT_TRUE(cached.ok()) << cached.status().ToString();
  auto cached_p = Placement::FromJson(cached->placement_json, "cached");
  ASSERT_TRUE(cached_p.ok()) << cached_p.status().ToString();
  const LayerPlacement& b = *cached_p->Layer(0);
  EXPECT_NE(RankOf(b, 0), RankOf(b, 6)) << cached->placement_json;
  EXPECT_LE(MaxRankLoad(load, b), MaxRankLoad(load, a));
  EXPECT_DOUBLE_EQ(MaxRankLoad(load, a), 22.0);
  EXPECT_GE(cached->layers[0].balancedness_after, plain->layers[0].balancedness_after);
  const LayerPlanReport& r = cached->layers[0];
  EXPECT_GT(r.hit_rate_after, plain_hit);
  EXPECT_DOUBLE_EQ(r.hit_rate_after, PlacementHitRate(load, b, 1, {1, 1, 1}));
  EXPECT_DOUBLE_EQ(r.hit_rate_after, 28.0 / 60);
  // Before: the linear placement {0,1,2} {3,4,5} {6,7,8} keeps 0, 5 (over 4: 8 > 7) and 6.
  EXPECT_DOUBLE_EQ(r.hit_rate_before, 28.0 / 60);
  EXPECT_DOUBLE_EQ(r.hit_rate_before, PlacementHitRate(load, *current->Layer(0), 1, {1, 1, 1}));

  // The same refinement on the planner's maps directly: only the hit rate moves.
  auto plain_maps = FromLayerPlacement(a, 1);
  ASSERT_TRUE(plain_maps.ok());
  const LayerMaps improved = ImproveForCache(load, *plain_maps, 3, {1, 1, 1});
  EXPECT_GT(PredictedHitRate(load, improved, 3, {1, 1, 1}),
            PredictedHitRate(load, *plain_maps, 3, {1, 1, 1}));
  EXPECT_GE(PredictedBalancedness(load, improved, 3), PredictedBalancedness(load, *plain_maps, 3));
  EXPECT_EQ(improved.logcnt, plain_maps->logcnt);
  EXPECT_TRUE(ToLayerPlacement(improved, 3, 1).ok());
}

TEST(CachePlanTest, ImproveForCacheNeverRaisesTheMaxOrDoublesAnExpert) {
  // A tight plan: ranks {e0 10, e3 0} {e1 6, e2 4} (max 10, perfect). Moving e0 off rank 0 or
  // pairing e1 with e3 would raise the max: nothing to do.
  const std::vector<double> load = {10, 6, 4, 0};
  const LayerMaps tight = Maps({0, 3, 1, 2}, 4);
  const LayerMaps same = ImproveForCache(load, tight, 2, {1, 1});
  EXPECT_EQ(same.phy2log, tight.phy2log);
  EXPECT_EQ(same.log2phy, tight.log2phy);
  // With replicas: e0 on both ranks is never swapped onto a rank that holds it.
  const std::vector<double> rep = {12, 5, 4, 3, 0};
  const LayerMaps m = ImproveForCache(rep, Maps({0, 1, 2, 0, 3, 4}, 5), 2, {1, 1});
  EXPECT_TRUE(ToLayerPlacement(m, 2, 1).ok());
  EXPECT_LE(1.0 / PredictedBalancedness(rep, m, 2),
            1.0 / PredictedBalancedness(rep, Maps({0, 1, 2, 0, 3, 4}, 5), 2));
}

TEST(CachePlanTest, Deterministic) {
  auto current = Placement::Linear(9, 4, 1);
  ASSERT_TRUE(current.ok());
  PlanOptions o;
  o.cache_experts = {1, 1, 1};
  auto first = MakePlan(kHotPair, *current, 0, o);
  ASSERT_TRUE(first.ok());
  for (int k = 0; k < 3; ++k) {
    auto again = MakePlan(kHotPair, *current, 0, o);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->placement_json, first->placement_json);
    EXPECT_EQ(again->layers[0].hit_rate_after, first->layers[0].hit_rate_after);
  }
  // 64 experts, 8 per rank in order, 3-expert caches: swaps raise the hit rate.
  std::vector<double> load(64);
  for (size_t e = 0; e < load.size(); ++e) load[e] = static_cast<double>((e * 11) % 64 + 1);
  std::vector<int> p2l(64);
  for (int s = 0; s < 64; ++s) p2l[static_cast<size_t>(s)] = s;
  const LayerMaps start = Maps(p2l, 64);
  const LayerMaps x = ImproveForCache(load, start, 8, std::vector<int>(8, 3));
  const LayerMaps y = ImproveForCache(load, start, 8, std::vector<int>(8, 3));
  EXPECT_EQ(x.phy2log, y.phy2log);
  EXPECT_GT(PredictedHitRate(load, x, 8, std::vector<int>(8, 3)),
            PredictedHitRate(load, start, 8, std::vector<int>(8, 3)));
  EXPECT_GE(PredictedBalancedness(load, x, 8), PredictedBalancedness(load, start, 8));
}

TEST(CachePlanTest, NoCacheLeavesThePlanAsItWas) {
  auto current = Placement::Linear(8, 5, 1);
  ASSERT_TRUE(current.ok());
  const std::map<int, std::vector<double>> loads = {{0, {400, 300, 10, 10, 10, 10, 10, 10}},
                                                    {1, {1, 2, 3, 4, 5, 6, 7, 8}}};
  PlanOptions o;
  o.redundant = 4;
  auto plain = MakePlan(loads, *current, 1000, o);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  for (const std::vector<int>& none :
       {std::vector<int>{}, std::vector<int>{0, 0, 0, 0}, std::vector<int>{0}}) {
    o.cache_experts = none;
    auto rep = MakePlan(loads, *current, 1000, o);
    ASSERT_TRUE(rep.ok()) << rep.status().ToString();
    EXPECT_EQ(rep->placement_json, plain->placement_json);
    for (size_t l = 0; l < rep->layers.size(); ++l) {
      EXPECT_EQ(rep->layers[l].hit_rate_before, 1.0);
      EXPECT_EQ(rep->layers[l].hit_rate_after, 1.0);
      EXPECT_EQ(rep->layers[l].balancedness_after, plain->layers[l].balancedness_after);
      EXPECT_EQ(rep->layers[l].experts_to_load, plain->layers[l].experts_to_load);
    }
  }
  // A cache with room for every hosted expert changes nothing either.
  o.cache_experts = {3, 3, 3, 3};
  auto roomy = MakePlan(loads, *current, 1000, o);
  ASSERT_TRUE(roomy.ok());
  EXPECT_EQ(roomy->placement_json, plain->placement_json);
  EXPECT_EQ(roomy->layers[0].hit_rate_after, 1.0);
}

TEST(CachePlanTest, DeadRanksAndTheirBudgets) {
  // Expert ranks 1..3 (budget indices 0..2); rank 2 is dead: planned ranks are 1 and 3, with the
  // budgets of indices 0 and 2.
  auto current = Placement::FromJson(
      R"({"format": "moerun-placement-v1", "version": 3, "num_experts": 6, "num_ranks": 4,
          "num_routers": 1, "layers": {"0": [[1,0],[1,1],[1,2],[3,3],[3,4],[3,5]]}})",
      "test");
  ASSERT_TRUE(current.ok()) << current.status().ToString();
  const std::map<int, std::vector<double>> loads = {{0, {300, 10, 10, 10, 10, 10}}};
  PlanOptions o;
  o.exclude = {2};
  o.cache_experts = {0, 1, 0};  // only the dead rank has a cache: as none
  auto rep = MakePlan(loads, *current, 0, o);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_EQ(rep->layers[0].hit_rate_before, 1.0);
  EXPECT_EQ(rep->layers[0].hit_rate_after, 1.0);
  o.cache_experts = {1, 0, 1};
  rep = MakePlan(loads, *current, 0, o);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  // Before: rank 1 keeps e0 (300 of 320), rank 3 one of its 10s (10 of 30).
  EXPECT_DOUBLE_EQ(rep->layers[0].hit_rate_before, 310.0 / 350);
  auto planned = Placement::FromJson(rep->placement_json, "plan");
  ASSERT_TRUE(planned.ok());
  EXPECT_TRUE(planned->Layer(0)->rank_slots[2].empty());
  EXPECT_DOUBLE_EQ(rep->layers[0].hit_rate_after,
                   PlacementHitRate(loads.at(0), *planned->Layer(0), 1, o.cache_experts, {2}));
}

TEST(CachePlanTest, BadBudgets) {
  auto current = Placement::Linear(8, 5, 1);  // 4 expert ranks
  ASSERT_TRUE(current.ok());
  const std::map<int, std::vector<double>> loads = {{0, {4, 3, 2, 1, 1, 1, 1, 1}}};
  PlanOptions o;
  o.cache_experts = {1, 1, 1, 1, 1};
  auto longer = MakePlan(loads, *current, 0, o);
  ASSERT_FALSE(longer.ok());
  EXPECT_EQ(longer.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(longer.status().message().find("5 expert cache budgets"), std::string::npos)
      << longer.status().ToString();
  EXPECT_NE(longer.status().message().find("4 expert ranks"), std::string::npos)
      << longer.status().ToString();
  o.cache_experts = {1, -1};
  auto negative = MakePlan(loads, *current, 0, o);
  ASSERT_FALSE(negative.ok());
  EXPECT_EQ(negative.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(negative.status().message().find("-1"), std::string::npos)
      << negative.status().ToString();
  o.cache_experts = {1, 1};  // shorter: the others have no cache
  EXPECT_TRUE(MakePlan(loads, *current, 0, o).ok());
  EXPECT_TRUE(CheckCacheExperts({}, 0, "x").ok());
  EXPECT_FALSE(CheckCacheExperts({0}, 0, "x").ok());
}

}  // namespace
}  // namespace moerun
