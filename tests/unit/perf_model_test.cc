// The performance model's math (launch/moebench/perf_model.h): a hand-computed small case, parts
// that add up, monotonicity, memory counted by hand, the batcher's cycle, the affine fit.
#include "launch/moebench/perf_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace moerun::bench {
namespace {

// hidden 4, inter 2, 4 experts top-2, F32: W = 3 * 4 * 2 = 24 weights per expert.
ModelShape SmallShape() {
  ModelShape m;
  m.hidden = 4;
  m.expert_inter = 2;
  m.experts = 4;
  m.top_k = 2;
  m.weight_bytes = 4;
  return m;
}

MachineProfile SimpleProfile() {
  MachineProfile p;
  p.kernel = {1000.0, 100.0, 0.0};  // ns per weight; per weight and row
  p.gate_fixed_us = 10;
  p.gate_mac_ns = 1;
  p.combine_value_ns = 2;
  p.link = {5.0, 1.0};  // 5 us, 1 GB/s
  p.net = p.link;
  return p;
}

Deployment TwoRanks(int64_t tokens) {
  Deployment d;
  d.routers = 1;
  d.expert_ranks = 2;
  d.tokens = tokens;
  d.slot_shares = UniformLinearSlots(4, 2);  // experts {0, 1} and {2, 3}, 1/4 each
  return d;
}

TEST(PerfModel, HandComputedSmallCase) {
  const ModelShape m = SmallShape();
  const MachineProfile p = SimpleProfile();
  const Deployment d = TwoRanks(10);
  const LayerPrediction r = PredictLayer(m, p, d);
  EXPECT_EQ(r.microbatches, 1);
  // Gate: 10 us + 10 tokens * 4 experts * 4 hidden * 1 ns = 10.16 us.
  EXPECT_NEAR(r.gate_ms, 0.01016, 1e-12);
  // Each rank: 10 * 2 * (1/4 + 1/4) = 10 rows, 40 * 4 = 160 bytes: 5 us + 0.16 us per message,
  // two messages one after another; pack: 10 * 2 * 4 values * 2 ns = 0.16 us.
  ASSERT_EQ(r.rows_per_rank.size(), 2u);
  EXPECT_DOUBLE_EQ(r.rows_per_rank[0], 10.0);
  EXPECT_NEAR(r.dispatch_ms, (2 * 5.16 + 0.16) / 1e3, 1e-12);
  EXPECT_NEAR(r.combine_ms, r.dispatch_ms, 1e-12);
  // Each expert: picked by a token with probability 2/4: P(used) = 1 - 0.5^10; 5 rows.
  const double used = 1.0 - std::pow(0.5, 10);
  const double expert_ns = used * 24 * 1000 + 5 * 24 * 100;
  EXPECT_NEAR(r.expert_ms, 2 * expert_ns / 1e6, 1e-12);
  EXPECT_NEAR(r.layer_ms, r.gate_ms + r.dispatch_ms + r.expert_ms + r.combine_ms, 1e-12);
  EXPECT_NEAR(r.tokens_per_s, 10 / (r.layer_ms / 1e3), 1e-6);
}

TEST(PerfModel, PartsAddWithoutMicrobatches) {
  const ModelShape m = SmallShape();
  MachineProfile p = SimpleProfile();
  for (int64_t t : {1, 7, 100, 1000}) {
    const LayerPrediction r = PredictLayer(m, p, TwoRanks(t));
    EXPECT_NEAR(r.layer_ms, r.gate_ms + r.dispatch_ms + r.expert_ms + r.combine_ms, 1e-9);
  }
}

TEST(PerfModel, MoreTokensTakeLongerButRunFasterPerToken) {
  const ModelShape m = SmallShape();
  const MachineProfile p = SimpleProfile();
  double last_ms = 0, last_tps = 0;
  for (int64_t t : {1, 4, 16, 64, 256, 1024}) {
    const LayerPrediction r = PredictLayer(m, p, TwoRanks(t));
    EXPECT_GT(r.layer_ms, last_ms);
    EXPECT_GE(r.tokens_per_s, last_tps);  // the fixed costs are shared by more tokens
    last_ms = r.layer_ms;
    last_tps = r.tokens_per_s;
  }
}

TEST(PerfModel, SlowerLinksAndKernelsTakeLonger) {
  const ModelShape m = SmallShape();
  const MachineProfile p = SimpleProfile();
  const double base = PredictLayer(m, p, TwoRanks(64)).layer_ms;
  MachineProfile slow_link = p;
  slow_link.link.gbps /= 2;
  EXPECT_GT(PredictLayer(m, slow_link, TwoRanks(64)).layer_ms, base);
  MachineProfile slow_kernel = p;
  slow_kernel.kernel.row_ns *= 2;
  EXPECT_GT(PredictLayer(m, slow_kernel, TwoRanks(64)).layer_ms, base);
}

TEST(PerfModel, SkewMakesTheHotRankTheSlowest) {
  const ModelShape m = SmallShape();
  const MachineProfile p = SimpleProfile();
  Deployment d = TwoRanks(256);
  const double even = PredictLayer(m, p, d).expert_ms;
  d.slot_shares = {{0.4, 0.3}, {0.2, 0.1}};
  const LayerPrediction r = PredictLayer(m, p, d);
  EXPECT_GT(r.expert_ms_per_rank[0], r.expert_ms_per_rank[1]);
  EXPECT_DOUBLE_EQ(r.expert_ms, r.expert_ms_per_rank[0]);
  EXPECT_GT(r.expert_ms, even);
}

TEST(PerfModel, MicrobatchesOverlapOnlyOnSeparateDevices) {
  const ModelShape m = SmallShape();
  MachineProfile p = SimpleProfile();
  Deployment d = TwoRanks(1024);
  d.microbatch_tokens = 256;
  const LayerPrediction r = PredictLayer(m, p, d);
  EXPECT_EQ(r.microbatches, 4);
  const double router = r.gate_ms + r.dispatch_ms + r.combine_ms;
  EXPECT_NEAR(r.layer_ms, router + r.expert_ms + 3 * std::max(router, r.expert_ms), 1e-9);
  // Oversubscribed cores: the ranks' work serializes and every part of every microbatch adds.
  p.cores = 2;
  p.threads = 2;
  const LayerPrediction o = PredictLayer(m, p, d);
  EXPECT_TRUE(o.oversubscribed);
  EXPECT_NEAR(o.expert_ms, o.expert_ms_per_rank[0] + o.expert_ms_per_rank[1], 1e-12);
  EXPECT_NEAR(o.layer_ms, 4 * (o.gate_ms + o.dispatch_ms + o.expert_ms + o.combine_ms), 1e-9);
}

TEST(PerfModel, MeasuredSharingScalesTheSlowestRank) {
  const ModelShape m = SmallShape();
  MachineProfile p = SimpleProfile();
  p.cores = 2;
  p.threads = 2;
  p.shared_factor = 1.5;  // ranks computing together: 1.5 x their time alone
  Deployment d = TwoRanks(256);
  d.slot_shares = {{0.4, 0.3}, {0.2, 0.1}};
  const LayerPrediction r = PredictLayer(m, p, d);
  EXPECT_TRUE(r.oversubscribed);
  EXPECT_NEAR(r.expert_ms, 1.5 * r.expert_ms_per_rank[0], 1e-12);
}

TEST(PerfModel, MemoryCountedByHand) {
  ModelShape m = SmallShape();
  m.shared_inter = 2;
  Deployment d = TwoRanks(10);
  const std::vector<RankMemory> mem = MemoryPerRank(m, d);
  ASSERT_EQ(mem.size(), 3u);
  EXPECT_TRUE(mem[0].router);
  // Router: gate 4 x 4 F32 = 64 B, shared expert 24 weights x 4 B = 96 B; input and output
  // 10 x 4 x 4 x 2 = 320 B, rows sent and received 10 x 2 x 4 x 4 x 2 = 640 B.
  EXPECT_DOUBLE_EQ(mem[0].weight_bytes, 64 + 96);
  EXPECT_DOUBLE_EQ(mem[0].buffer_bytes, 320 + 640);
  // Expert rank: 2 experts x 24 x 4 B; 10 rows x (4 x 4 x 2 + 2 x 2 x 4) B.
  EXPECT_DOUBLE_EQ(mem[1].weight_bytes, 2 * 24 * 4);
  EXPECT_DOUBLE_EQ(mem[1].buffer_bytes, 10 * (32 + 16));
  EXPECT_DOUBLE_EQ(mem[1].total(), mem[1].weight_bytes + mem[1].buffer_bytes);
}

TEST(PerfModel, ServedLatencyFollowsTheBatcherCycle) {
  const ModelShape m = SmallShape();
  const MachineProfile p = SimpleProfile();
  // A slow rate: one request per batch, dispatched at once (the router is nearly always free):
  // the latency is the batch's own, whatever max_wait_us.
  const ServedPrediction slow = PredictServed(m, p, TwoRanks(1), 1.0, 1, 1024, 2000, 0);
  EXPECT_FALSE(slow.saturated);
  EXPECT_DOUBLE_EQ(slow.batch_tokens, 1.0);
  EXPECT_DOUBLE_EQ(slow.cycle_ms, slow.batch_ms);
  EXPECT_NEAR(slow.p50_ms, slow.batch_ms, 1e-12);
  EXPECT_NEAR(slow.p99_ms, slow.batch_ms, 1e-12);
  EXPECT_DOUBLE_EQ(slow.tokens_per_s, 1.0);
  EXPECT_DOUBLE_EQ(PredictServed(m, p, TwoRanks(1), 1.0, 1, 1024, 0, 0).p50_ms, slow.p50_ms);
  // Beyond the capacity: saturated, tokens/s is the capacity.
  const double cap = slow.capacity_tokens_per_s;
  const ServedPrediction over = PredictServed(m, p, TwoRanks(1), 2 * cap, 1, 1024, 2000, 0);
  EXPECT_TRUE(over.saturated);
  EXPECT_DOUBLE_EQ(over.tokens_per_s, cap);
  // Busier but below capacity: bigger batches, latency at least the quiet one's.
  const ServedPrediction busy = PredictServed(m, p, TwoRanks(1), 0.5 * cap, 1, 1024, 2000, 0);
  EXPECT_FALSE(busy.saturated);
  EXPECT_GT(busy.batch_tokens, slow.batch_tokens);
  EXPECT_GE(busy.p50_ms, slow.p50_ms);
  EXPECT_GE(busy.p99_ms, busy.p50_ms);
}

TEST(PerfModel, AffineFitRecoversALine) {
  const AffineFit f = FitAffine({1, 2, 3, 4}, {3, 5, 7, 9});
  EXPECT_NEAR(f.a, 1.0, 1e-12);
  EXPECT_NEAR(f.b, 2.0, 1e-12);
  const AffineFit one = FitAffine({5, 5}, {2, 4});
  EXPECT_DOUBLE_EQ(one.a, 3.0);
  EXPECT_DOUBLE_EQ(one.b, 0.0);
}

}  // namespace
}  // namespace moerun::bench
