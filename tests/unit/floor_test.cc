// The device floor of `moebench layer --device cuda` (launch/moebench/floor.h): hand-computed
// values and the floor column of the H200 table in /work/shared/ANCHORS.md.
#include "launch/moebench/floor.h"

#include <gtest/gtest.h>

namespace moerun::bench {
namespace {

FloorInput Shape(int64_t hidden, int64_t inter, int64_t experts, int64_t k, int64_t tokens,
                 int64_t active) {
  FloorInput in;
  in.hidden = hidden;
  in.expert_inter = inter;
  in.num_experts = experts;
  in.top_k = k;
  in.tokens = tokens;
  in.active_experts = active;
  in.weight_bytes_per_element = 2;  // bf16
  return in;
}

FloorInput Mixtral(int64_t tokens, int64_t active) {
  return Shape(4096, 14336, 8, 2, tokens, active);
}
FloorInput Qwen3(int64_t tokens, int64_t active) {
  return Shape(2048, 768, 128, 8, tokens, active);
}
FloorInput DeepSeekV3(int64_t tokens, int64_t active) {
  return Shape(7168, 2048, 256, 8, tokens, active);
}

TEST(FloorTest, MixtralOneTokenReadsTwoExperts) {
  const Floor f = ComputeFloor(Mixtral(1, 2));
  // 2 experts x 3 x 4096 x 14336 x 2 B.
  EXPECT_DOUBLE_EQ(f.bytes, 704643072.0);
  // Gate 2*1*4096*8 + experts 2*1*2*3*4096*14336.
  EXPECT_DOUBLE_EQ(f.flops, 65536.0 + 704643072.0);
  EXPECT_NEAR(f.memory_ms, 704643072.0 / 4.24e12 * 1e3, 1e-12);
  EXPECT_TRUE(f.memory_bound());
  EXPECT_DOUBLE_EQ(f.ms, f.memory_ms);
  EXPECT_NEAR(f.ms, 0.1662, 1e-4);
}

TEST(FloorTest, Qwen3At8192TokensIsComputeBound) {
  const Floor f = ComputeFloor(Qwen3(8192, 128));
  EXPECT_DOUBLE_EQ(f.bytes, 3.0 * 2048 * 768 * 2 * 128);  // 1.208 GB
  // Gate 2*8192*2048*128 + experts 2*8192*8*3*2048*768.
  EXPECT_DOUBLE_EQ(f.flops, 4294967296.0 + 618475290624.0);
  EXPECT_FALSE(f.memory_bound());
  EXPECT_NEAR(f.memory_ms, 0.2849, 1e-4);
  EXPECT_NEAR(f.compute_ms, 622770257920.0 / 806e12 * 1e3, 1e-12);
  EXPECT_DOUBLE_EQ(f.ms, f.compute_ms);
}

TEST(FloorTest, SharedExpertAndGateWeightsCount) {
  FloorInput in = DeepSeekV3(1, 8);
  in.shared_inter = 2048;
  in.gate_bytes_per_element = 4;  // fp32 gate
  const Floor f = ComputeFloor(in);
  // 8 routed + 1 shared expert of 3 x 7168 x 2048 x 2 B, and the gate 7168 x 256 x 4 B.
  EXPECT_DOUBLE_EQ(f.bytes, 9 * 88080384.0 + 7340032.0);
  EXPECT_DOUBLE_EQ(f.flops, 3670016.0 + 704643072.0 + 88080384.0);
}

TEST(FloorTest, F32WeightsReadTwiceTheBytes) {
  FloorInput in = Qwen3(1, 8);
  const double bf16 = LayerWeightBytes(in);
  in.weight_bytes_per_element = 4;
  EXPECT_DOUBLE_EQ(LayerWeightBytes(in), 2 * bf16);
}

TEST(FloorTest, RatesOverride) {
  FloorRates r;
  r.bytes_per_s = 1e12;
  r.flops_per_s = 1e15;
  const Floor f = ComputeFloor(Mixtral(1, 2), r);
  EXPECT_NEAR(f.memory_ms, 0.704643072, 1e-12);
  EXPECT_NEAR(f.compute_ms, (65536.0 + 704643072.0) / 1e15 * 1e3, 1e-15);
  FloorRates none;
  none.bytes_per_s = 0;
  none.flops_per_s = 0;
  EXPECT_EQ(ComputeFloor(Mixtral(1, 2), none).ms, 0);
}

// The floor column of ANCHORS.md (weights of routed experts only, three decimals) where the
// active expert count follows from the token count: k experts at 1 token, all of them once
// tokens x k far exceeds the expert count.
TEST(FloorTest, MatchesAnchorsTable) {
  struct Row {
    const char* what;
    FloorInput in;
    double table_ms;
  };
  const Row rows[] = {
      {"mixtral 1", Mixtral(1, 2), 0.166},
      {"mixtral 128", Mixtral(128, 8), 0.665},
      {"mixtral 1024", Mixtral(1024, 8), 0.896},
      {"mixtral 8192", Mixtral(8192, 8), 7.166},
      {"qwen3 1", Qwen3(1, 8), 0.018},
      {"qwen3 128", Qwen3(128, 128), 0.285},
      {"qwen3 1024", Qwen3(1024, 128), 0.287},
      {"qwen3 8192", Qwen3(8192, 128), 0.768},
      {"deepseek 1", DeepSeekV3(1, 8), 0.166},
      {"deepseek 1024", DeepSeekV3(1024, 256), 5.320},
      {"deepseek 8192", DeepSeekV3(8192, 256), 7.166},
  };
  for (const Row& r : rows) {
    const double ms = ComputeFloor(r.in).ms;
    EXPECT_NEAR(ms, r.table_ms, 0.0005 + 0.01 * r.table_ms) << r.what;
  }
}

TEST(FloorTest, CountsDistinctExperts) {
  EXPECT_EQ(CountActiveExperts({}), 0);
  EXPECT_EQ(CountActiveExperts({3, 1, 3, 0, 1, 3}), 3);
  EXPECT_EQ(CountActiveExperts({-1, 5, 5}), 1);
}

}  // namespace
}  // namespace moerun::bench
