#include "router/gate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "router/combine.h"
#include "router/expert_groups.h"

namespace moerun {
namespace {

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> w;
};

Routed RouteOne(const GateSpec& g, const std::vector<float>& logits,
                const std::vector<float>& bias = {}) {
  std::vector<float> probs(logits.size()), choice(logits.size());
  std::vector<int32_t> order(logits.size());
  Routed r{std::vector<int32_t>(static_cast<size_t>(g.top_k)),
           std::vector<float>(static_cast<size_t>(g.top_k))};
  Route(g, logits.data(), bias.empty() ? nullptr : bias.data(),
        GateScratch{probs.data(), choice.data(), order.data()}, r.ids.data(), r.w.data());
  return r;
}

GateSpec Spec(GateKind kind, int n, int k) {
  GateSpec g;
  g.kind = kind;
  g.num_experts = n;
  g.top_k = k;
  return g;
}

TEST(GateTest, SoftmaxTopKRenormalised) {
  GateSpec g = Spec(GateKind::kSoftmaxTopK, 4, 2);
  const std::vector<float> logits = {0.0f, 2.0f, 1.0f, -1.0f};
  const Routed r = RouteOne(g, logits);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  const double e1 = std::exp(2.0), e2 = std::exp(1.0);
  EXPECT_NEAR(r.w[0], e1 / (e1 + e2), 1e-7);
  EXPECT_NEAR(r.w[1], e2 / (e1 + e2), 1e-7);
}

TEST(GateTest, SoftmaxTopKNotRenormalised) {
  GateSpec g = Spec(GateKind::kSoftmaxTopK, 4, 2);
  g.renormalize = false;
  const std::vector<float> logits = {0.0f, 2.0f, 1.0f, -1.0f};
  const Routed r = RouteOne(g, logits);
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  EXPECT_NEAR(r.w[0], std::exp(2.0) / z, 1e-7);
  EXPECT_NEAR(r.w[1], std::exp(1.0) / z, 1e-7);
}

TEST(GateTest, SoftmaxTopKScaled) {  // Step-3.5 without router bias, softmax: no renorm, x scale
  GateSpec g = Spec(GateKind::kSoftmaxTopK, 4, 2);
  g.renormalize = false;
  g.scale = 3.0f;
  const std::vector<float> logits = {0.0f, 2.0f, 1.0f, -1.0f};
  const Routed r = RouteOne(g, logits);
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(r.w[0], 3.0 * std::exp(2.0) / z, 1e-6);
  EXPECT_NEAR(r.w[1], 3.0 * std::exp(1.0) / z, 1e-6);
}

TEST(GateTest, Bf16LogitsAreRoundedFirst) {
  // 1.001 and 1.002 both round to bfloat16 1.0: tied, so the lower index wins, and the weights
  // are the rounded logits' (sigmoid(1) each, renormalised to 1/2).
  GateSpec g = Spec(GateKind::kSigmoidTopK, 3, 1);
  const std::vector<float> logits = {1.001f, 1.002f, -3.0f};
  EXPECT_EQ(RouteOne(g, logits).ids, (std::vector<int32_t>{1}));
  g.bf16_logits = true;
  EXPECT_EQ(RouteOne(g, logits).ids, (std::vector<int32_t>{0}));
  g.top_k = 2;
  g.scale = 3.0f;
  const Routed r = RouteOne(g, logits);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(r.w[0], 1.5f);
  EXPECT_EQ(r.w[1], 1.5f);
  g.kind = GateKind::kSoftmaxTopK;  // the softmax of the rounded logits
  g.renormalize = false;
  g.scale = 1.0f;
  const Routed s = RouteOne(g, logits);
  const double e = std::exp(1.0), z = 2 * e + std::exp(-3.0);
  EXPECT_NEAR(s.w[0], e / z, 1e-7);
  EXPECT_EQ(s.w[0], s.w[1]);
}

TEST(GateTest, TiesGoToTheLowerIndex) {
  const GateSpec g = Spec(GateKind::kSoftmaxTopK, 5, 3);
  const Routed r = RouteOne(g, {1.0f, 3.0f, 1.0f, 3.0f, 1.0f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3, 0}));
}

TEST(GateTest, NanLogitsRankLast) {
  const GateSpec g = Spec(GateKind::kTopKSoftmax, 4, 2);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Routed r = RouteOne(g, {nan, 1.0f, nan, 0.5f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3}));
}

TEST(GateTest, SigmoidBiasChoosesButDoesNotWeigh) {
  GateSpec g = Spec(GateKind::kSigmoidTopK, 4, 2);
  g.selection_bias = true;
  g.renorm_eps = 1e-20f;
  g.scale = 2.5f;
  const std::vector<float> logits = {2.0f, 1.0f, 0.0f, -1.0f};
  const std::vector<float> bias = {0.0f, 0.0f, 0.0f, 5.0f};  // makes expert 3 win the choice
  const Routed r = RouteOne(g, logits, bias);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 0}));
  const double s3 = 1 / (1 + std::exp(1.0)), s0 = 1 / (1 + std::exp(-2.0));
  EXPECT_NEAR(r.w[0], 2.5 * s3 / (s3 + s0), 1e-6);
  EXPECT_NEAR(r.w[1], 2.5 * s0 / (s3 + s0), 1e-6);
}

TEST(GateTest, GroupLimitedSelection) {
  // 4 groups of 2; group scores are the sum of their two members: keep the best 2 groups.
  GateSpec g = Spec(GateKind::kSigmoidTopK, 8, 2);
  g.n_group = 4;
  g.topk_group = 2;
  g.renorm_eps = 1e-20f;
  // Expert 0 has the single best score, but its group (0, 1) sums lower than groups 1 and 2.
  const std::vector<float> logits = {4.0f, -4.0f, 1.0f, 1.0f, 0.9f, 0.9f, -2.0f, -2.0f};
  const Routed r = RouteOne(g, logits);
  for (int32_t id : r.ids) EXPECT_TRUE(id >= 2 && id <= 5) << id;
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 3}));
}

TEST(GateTest, TopKThenSoftmax) {
  const GateSpec g = Spec(GateKind::kTopKSoftmax, 4, 2);
  const Routed r = RouteOne(g, {0.5f, 3.0f, 2.0f, -1.0f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  const double e = std::exp(-1.0);
  EXPECT_NEAR(r.w[0], 1 / (1 + e), 1e-7);
  EXPECT_NEAR(r.w[1], e / (1 + e), 1e-7);
}

TEST(ExpertGroupsTest, GroupsByExpertThenToken) {
  // 3 tokens, top-2, 4 experts.
  const std::vector<int32_t> ids = {2, 0, 0, 3, 2, 0};
  ExpertGroups g;
  g.Build(ids.data(), 3, 2, 4);
  EXPECT_EQ(g.offset, (std::vector<int64_t>{0, 3, 3, 5, 6}));
  EXPECT_EQ(g.row_token, (std::vector<int32_t>{0, 1, 2, 0, 2, 1}));
  for (int i = 0; i < 6; ++i) {
    const int64_t row = g.slot_row[static_cast<size_t>(i)];
    EXPECT_EQ(g.row_token[static_cast<size_t>(row)], i / 2);
    const int e = ids[static_cast<size_t>(i)];
    EXPECT_GE(row, g.offset[static_cast<size_t>(e)]);
    EXPECT_LT(row, g.offset[static_cast<size_t>(e) + 1]);
  }
}

TEST(CombineTest, WeightedSumInSlotOrderPlusShared) {
  const std::vector<float> a = {1, 2, 3}, b = {10, 20, 30}, s = {100, 200, 300};
  const float* rows[2] = {a.data(), b.data()};
  const float w[2] = {0.5f, 0.25f};
  std::vector<float> out(3);
  CombineToken(2, 3, rows, w, s.data(), 0.5f, out.data());
  EXPECT_EQ(out, (std::vector<float>{53.0f, 106.0f, 159.0f}));
  CombineToken(2, 3, rows, w, nullptr, 0.0f, out.data());
  EXPECT_EQ(out, (std::vector<float>{3.0f, 6.0f, 9.0f}));
}

}  // namespace
}  // namespace moerun
