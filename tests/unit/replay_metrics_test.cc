#include "router/replay/replay_metrics.h"

#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "tests/unit/test_util.h"

namespace moerun {
namespace {

// A token-level trace of one layer and one stream: ids token by token (k each).
RoutingTrace RmTrace(int experts, int k, const std::vector<int32_t>& ids) {
  RoutingTrace t;
  t.source = "hand";
  t.num_experts = experts;
  t.top_k = k;
  t.layers = {0};
  RoutingTrace::Stream s;
  s.name = "s";
  s.tokens = static_cast<int64_t>(ids.size()) / k;
  s.ids = {ids};
  t.streams.push_back(s);
  CountFromStreams(&t);
  return t;
}

LayerMaps RmMaps(const std::vector<int>& phy2log, int experts) {
  LayerMaps m;
  m.phy2log = phy2log;
  m.log2phy.resize(static_cast<size_t>(experts));
  m.logcnt.assign(static_cast<size_t>(experts), 0);
  for (size_t s = 0; s < phy2log.size(); ++s) {
    m.log2phy[static_cast<size_t>(phy2log[s])].push_back(static_cast<int>(s));
    ++m.logcnt[static_cast<size_t>(phy2log[s])];
  }
  return m;
}

BatchMetrics RmMeasure(const RoutingTrace& t, const std::vector<LayerMaps>& plan,
                       const ReplayTopology& topo, int64_t b) {
  Result<BatchMetrics> m = MeasureBatches(t, plan, topo, b);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? *m : BatchMetrics{};
}

TEST(ReplayMetricsTest, WindowBalancednessOfHandCases) {
  // 4 experts on 2 ranks: rank 0 {0, 1}, rank 1 {2, 3}.
  RoutingTrace t;
  t.num_experts = 4;
  t.layers = {5, 6};
  t.counts = {{1, 1, 1, 1}, {4, 0, 0, 0}};
  const std::vector<LayerMaps> plan(2, RmMaps({0, 1, 2, 3}, 4));
  Result<WindowBalance> w = WindowBalancedness(t, plan, 2);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->per_layer, (std::vector<double>{1.0, 0.5}));  // mean 2 / max 4
  EXPECT_DOUBLE_EQ(w->mean, 0.75);
  EXPECT_DOUBLE_EQ(w->min, 0.5);
  // Expert 0 on both ranks (and expert 1): expert 0's load splits, both ranks carry 2.
  const std::vector<LayerMaps> rep(2, RmMaps({0, 1, 2, 0, 3, 1}, 4));
  Result<WindowBalance> r = WindowBalancedness(t, rep, 2);
  ASSERT_TRUE(r.ok());
  EXPECT_DOUBLE_EQ(r->per_layer[1], 1.0);
  // A plan of the wrong length, or that leaves an expert out, is refused.
  EXPECT_FALSE(WindowBalancedness(t, {plan[0]}, 2).ok());
  EXPECT_FALSE(WindowBalancedness(t, std::vector<LayerMaps>(2, RmMaps({0, 1, 2, 2}, 4)), 2).ok());
}

TEST(ReplayMetricsTest, ImbalanceIsZeroWhenPerfectAndRanksMinusOneWhenOneRankTakesAll) {
  const std::vector<LayerMaps> plan = {RmMaps({0, 1, 2, 3}, 4)};  // rank r holds expert r
  ReplayTopology topo;
  topo.num_ranks = 4;
  // One batch of 4 tokens, one per rank: imbalance 0, every rank computes 1 expert.
  BatchMetrics m = RmMeasure(RmTrace(4, 1, {0, 1, 2, 3}), plan, topo, 4);
  EXPECT_EQ(m.batches, 1);
  EXPECT_EQ(m.imbalance_mean, 0.0);
  EXPECT_EQ(m.imbalance_max, 0.0);
  EXPECT_EQ(m.max_rank_experts_max, 1.0);
  // All on expert 2: (4 - 1) / 1 = R - 1.
  m = RmMeasure(RmTrace(4, 1, {2, 2, 2, 2}), plan, topo, 4);
  EXPECT_DOUBLE_EQ(m.imbalance_mean, 3.0);
  EXPECT_DOUBLE_EQ(m.imbalance_p50, 3.0);
  // With one node nothing leaves it.
  EXPECT_EQ(m.off_node_share_rows, 0.0);
  EXPECT_EQ(m.off_node_share_token_node, 0.0);
  EXPECT_EQ(m.nodes_per_token, 1.0);
  EXPECT_EQ(m.off_node_copies_per_token, 0.0);
}

TEST(ReplayMetricsTest, BatchesAreFullAndAPartialBatchIsLeftOut) {
  const std::vector<LayerMaps> plan = {RmMaps({0, 1, 2, 3}, 4)};
  ReplayTopology topo;
  topo.num_ranks = 2;  // rank 0 {0, 1}, rank 1 {2, 3}
  // 5 tokens, batches of 2: [0, 2] balanced (0), [0, 1] all on rank 0 (1), token 5 left out.
  const RoutingTrace t = RmTrace(4, 1, {0, 2, 0, 1, 3});
  BatchMetrics m = RmMeasure(t, plan, topo, 2);
  EXPECT_EQ(m.batches, 2);
  EXPECT_EQ(m.tokens_judged, 4);
  EXPECT_EQ(m.tokens_left_out, 1);
  EXPECT_DOUBLE_EQ(m.imbalance_mean, 0.5);
  EXPECT_DOUBLE_EQ(m.imbalance_p50, 0.0);
  EXPECT_DOUBLE_EQ(m.imbalance_max, 1.0);
  EXPECT_DOUBLE_EQ(m.max_rank_experts_mean, 1.5);  // 1, then 2 (rank 0 computes 0 and 1)
  EXPECT_DOUBLE_EQ(m.max_rank_experts_max, 2.0);
  // No full batch of 8.
  m = RmMeasure(t, plan, topo, 8);
  EXPECT_EQ(m.batches, 0);
  EXPECT_EQ(m.tokens_left_out, 5);
  // A missing record (-1) leaves that token out of its layer: [0, -1] counts only token 0.
  m = RmMeasure(RmTrace(4, 1, {0, -1}), plan, topo, 2);
  EXPECT_EQ(m.batches, 1);
  EXPECT_DOUBLE_EQ(m.imbalance_max, 1.0);
}

TEST(ReplayMetricsTest, ReplicaChoiceIsTheRuntimesLeastLoadedRank) {
  // Expert 0 on both ranks (slots 0, 2), expert 1 on rank 0.
  const std::vector<LayerMaps> plan = {RmMaps({0, 1, 0, 1}, 2)};
  ReplayTopology topo;
  topo.num_ranks = 2;
  // One router: 3 tokens of expert 0 alternate rank 0, 1, 0: loads 2, 1: (2 - 1.5) / 1.5.
  BatchMetrics m = RmMeasure(RmTrace(2, 1, {0, 0, 0}), plan, topo, 3);
  EXPECT_DOUBLE_EQ(m.imbalance_mean, 0.5 / 1.5);
  // Two routers (2 nodes), 4 tokens: each router starts from zero and sends one to each rank.
  topo.num_nodes = 2;
  m = RmMeasure(RmTrace(2, 1, {0, 0, 0, 0}), plan, topo, 4);
  EXPECT_DOUBLE_EQ(m.imbalance_mean, 0.0);
  // Router 0 (node 0): token 0 to rank 0 (home), token 1 to rank 1; router 1 the same.
  EXPECT_DOUBLE_EQ(m.off_node_share_rows, 0.5);
}

TEST(ReplayMetricsTest, OffNodeSharesCountRowsRanksAndNodes) {
  // 2 ranks on 2 nodes (one each), one router per node; rank 0 {0, 1}, rank 1 {2, 3}.
  const std::vector<LayerMaps> plan = {RmMaps({0, 1, 2, 3}, 4)};
  ReplayTopology topo;
  topo.num_ranks = 2;
  topo.num_nodes = 2;
  topo.routers_per_node = 1;
  // Token 0 (router 0, node 0) -> experts 2, 3: both rows to rank 1 (node 1);
  // token 1 (router 1, node 1) -> experts 0, 2: a row to rank 0 (away), one to rank 1 (home).
  const BatchMetrics m = RmMeasure(RmTrace(4, 2, {2, 3, 0, 2}), plan, topo, 2);
  EXPECT_EQ(m.batches, 1);
  EXPECT_DOUBLE_EQ(m.off_node_share_rows, 3.0 / 4);        // 3 of 4 rows
  EXPECT_DOUBLE_EQ(m.off_node_share_token_rank, 2.0 / 3);  // (t0, r1), (t1, r0) of 3 pairs
  EXPECT_DOUBLE_EQ(m.off_node_share_token_node, 2.0 / 3);  // (t0, n1), (t1, n0) of 3 pairs
  EXPECT_DOUBLE_EQ(m.nodes_per_token, 1.5);
  EXPECT_DOUBLE_EQ(m.off_node_copies_per_token, 1.0);  // 2 remote (token, node) pairs, 2 tokens
  EXPECT_DOUBLE_EQ(m.imbalance_mean, 0.5);             // rank loads 1, 3
  EXPECT_DOUBLE_EQ(m.max_rank_experts_max, 2.0);
  // 4 ranks on 2 nodes: a token's two rows to ranks 2 and 3 (both node 1) cost two (token,
  // rank) copies but one (token, node) copy.
  topo.num_ranks = 4;
  const BatchMetrics n = RmMeasure(RmTrace(4, 2, {2, 3, 2, 3}), plan, topo, 2);
  EXPECT_DOUBLE_EQ(n.off_node_share_token_rank, 0.5);  // token 0: 2 remote of its 2
  EXPECT_DOUBLE_EQ(n.off_node_share_token_node, 0.5);  // token 0: 1 remote of its 1
  EXPECT_DOUBLE_EQ(n.nodes_per_token, 1.0);
}

TEST(ReplayMetricsTest, ReplayPlacementAcceptsAnExpertTwiceOnARank) {
  const LayerMaps twice = RmMaps({0, 0, 1, 1}, 2);  // rank 0 holds expert 0 twice
  EXPECT_FALSE(ToLayerPlacement(twice, 2, 0).ok());
  Result<LayerPlacement> lp = ReplayPlacement(twice, 2, 2);
  ASSERT_TRUE(lp.ok()) << lp.status().ToString();
  EXPECT_EQ(lp->replicas[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(lp->rank_slots[1], (std::vector<int>{2, 3}));
  // Both copies on rank 0 count as one expert computed.
  ReplayTopology topo;
  topo.num_ranks = 2;
  const BatchMetrics m = RmMeasure(RmTrace(2, 1, {0, 0, 0}), {twice}, topo, 3);
  EXPECT_EQ(m.max_rank_experts_max, 1.0);
  EXPECT_DOUBLE_EQ(m.imbalance_mean, 1.0);
  // Bad maps: slots not dividing, an expert without a slot, an id out of range.
  EXPECT_FALSE(ReplayPlacement(RmMaps({0, 1, 1}, 2), 2, 2).ok());
  EXPECT_FALSE(ReplayPlacement(RmMaps({0, 0}, 2), 2, 2).ok());
  EXPECT_FALSE(ReplayPlacement(RmMaps({0, 2}, 3), 2, 2).ok());
}

TEST(ReplayMetricsTest, MatchesTheRuntimePlacementOnARealPlan) {
  Result<RoutingTrace> t = ReadRoutingTrace(
      testing::DataDir() + "/routing/qwen3-30b-a3b/batch_8_topk_ids_layers48_x_tokens_x_top8.npy");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  PlannerInput in;
  in.load = t->counts;
  in.num_ranks = 8;
  in.num_slots = 128 + 8;
  in.num_nodes = 2;
  Result<std::vector<LayerMaps>> plan = PlanPlacement(in, PlannerPolicy::kDefault);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  int compared = 0;
  for (const LayerMaps& maps : *plan) {
    Result<LayerPlacement> ours = ReplayPlacement(maps, 128, 8);
    ASSERT_TRUE(ours.ok()) << ours.status().ToString();
    Result<LayerPlacement> runtime = ToLayerPlacement(maps, 8, 0);
    if (!runtime.ok()) continue;  // an expert twice on a rank: the runtime's table refuses it
    ++compared;
    EXPECT_TRUE(Placement::SameSlots(*ours, *runtime));
    EXPECT_EQ(ours->replicas, runtime->replicas);
    EXPECT_EQ(ours->rank_slots, runtime->rank_slots);
  }
  EXPECT_GT(compared, 0);
  ReplayTopology topo;
  topo.num_ranks = 8;
  topo.num_nodes = 2;
  topo.routers_per_node = 2;
  const BatchMetrics m = RmMeasure(*t, *plan, topo, 256);
  EXPECT_EQ(m.batches, 48 * 8);
  EXPECT_EQ(m.tokens_judged, 2048);  // per layer
  EXPECT_EQ(m.tokens_left_out, 2);
  EXPECT_GE(m.imbalance_p50, 0.0);
  EXPECT_LE(m.imbalance_p50, m.imbalance_p95);
  EXPECT_LE(m.imbalance_p95, m.imbalance_max);
  EXPECT_LE(m.imbalance_max, 7.0);
  for (double share :
       {m.off_node_share_rows, m.off_node_share_token_rank, m.off_node_share_token_node}) {
    EXPECT_GT(share, 0.0);
    EXPECT_LT(share, 1.0);
  }
  EXPECT_GE(m.nodes_per_token, 1.0);
  EXPECT_LE(m.nodes_per_token, 2.0);
  EXPECT_LE(m.max_rank_experts_max, 17.0);  // 136 slots / 8 ranks
}

TEST(ReplayMetricsTest, SplitTracePlansOnPartAndJudgesOnTheRest) {
  RoutingTrace t = RmTrace(4, 1, {0, 1, 2, 3, 0, 0, 1, 1, 2, 3});
  RoutingTrace::Stream second = t.streams[0];
  second.name = "t";
  second.tokens = 3;
  second.ids = {{3, 3, 3}};
  t.streams.push_back(second);
  CountFromStreams(&t);
  Result<TraceParts> p = SplitTrace(t, 0.5, SplitBy::kTokens);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_EQ(p->plan.streams.size(), 2u);
  EXPECT_EQ(p->plan.streams[0].tokens, 5);
  EXPECT_EQ(p->plan.streams[1].tokens, 1);  // floor(1.5)
  EXPECT_EQ(p->judge.streams[0].tokens, 5);
  EXPECT_EQ(p->judge.streams[1].tokens, 2);
  EXPECT_EQ(p->plan.counts[0], (std::vector<double>{2, 1, 1, 2}));
  EXPECT_EQ(p->judge.counts[0], (std::vector<double>{1, 2, 1, 3}));
  EXPECT_EQ(p->plan.layers, t.layers);
  // By streams: the first stream plans, the second is judged.
  p = SplitTrace(t, 0.5, SplitBy::kStreams);
  ASSERT_TRUE(p.ok());
  ASSERT_EQ(p->plan.streams.size(), 1u);
  EXPECT_EQ(p->plan.streams[0].name, "s");
  EXPECT_EQ(p->judge.counts[0], (std::vector<double>{0, 0, 0, 3}));
  // Fractions outside (0, 1), a part left empty, window counts: errors.
  EXPECT_FALSE(SplitTrace(t, 0.0, SplitBy::kTokens).ok());
  EXPECT_FALSE(SplitTrace(t, 1.0, SplitBy::kTokens).ok());
  EXPECT_FALSE(SplitTrace(t, 0.2, SplitBy::kStreams).ok());
  RoutingTrace window;
  window.num_experts = 2;
  window.counts = {{1, 2}};
  window.layers = {0};
  EXPECT_FALSE(SplitTrace(window, 0.5, SplitBy::kTokens).ok());
  ReplayTopology topo;
  EXPECT_FALSE(MeasureBatches(window, {RmMaps({0, 1}, 2)}, topo, 1).ok());
}

TEST(ReplayMetricsTest, NearestRankPercentileAndBadTopologies) {
  EXPECT_EQ(NearestRankPercentile({4, 1, 3, 2}, 0.5), 2);
  EXPECT_EQ(NearestRankPercentile({4, 1, 3, 2}, 0.95), 4);
  EXPECT_EQ(NearestRankPercentile({4, 1, 3, 2}, 1.0), 4);
  EXPECT_EQ(NearestRankPercentile({}, 0.5), 0);
  ReplayTopology topo;
  topo.num_ranks = 4;
  topo.num_nodes = 3;
  EXPECT_FALSE(CheckTopology(topo).ok());
  topo.num_nodes = 2;
  topo.routers_per_node = 0;
  EXPECT_FALSE(CheckTopology(topo).ok());
  topo.routers_per_node = 1;
  EXPECT_TRUE(CheckTopology(topo).ok());
  EXPECT_FALSE(MeasureBatches(RmTrace(4, 1, {0, 1}), {RmMaps({0, 1, 2, 3}, 4)}, topo, 0).ok());
}

}  // namespace
}  // namespace moerun
