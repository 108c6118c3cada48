#include "router/activation_load.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

namespace moerun {
namespace {

TEST(ActivationLoadTest, ExactValues) {
  auto a = ActivationLoad({{0, 50, 100, 25}}, 100, 2);
  ASSERT_TRUE(a.ok());
  EXPECT_DOUBLE_EQ((*a)[0][0], 0.0);   // never chosen
  EXPECT_DOUBLE_EQ((*a)[0][1], 0.75);  // 1 - 0.5^2
  EXPECT_DOUBLE_EQ((*a)[0][2], 1.0);   // every token
  EXPECT_NEAR((*a)[0][3], 1 - 0.75 * 0.75, 1e-15);
  // One token per batch: the share itself.
  auto one = ActivationLoad({{30, 70}}, 100, 1);
  ASSERT_TRUE(one.ok());
  EXPECT_NEAR((*one)[0][0], 0.3, 1e-15);
}

// Against the count of distinct experts in sampled batches: independent draws with the shares
// of the counts (the formula's assumption), the mean number of batches each expert appears in.
TEST(ActivationLoadTest, MatchesSampledBatches) {
  const std::vector<double> counts = {400, 200, 200, 100, 50, 30, 15, 5};
  const double tokens = 1000;  // top-1
  std::mt19937 rng(5);
  std::discrete_distribution<int> pick(counts.begin(), counts.end());
  const int batches = 20000, b = 4;
  std::vector<double> seen(counts.size(), 0);
  for (int i = 0; i < batches; ++i) {
    std::set<int> used;
    for (int t = 0; t < b; ++t) used.insert(pick(rng));
    for (int e : used) seen[static_cast<size_t>(e)] += 1.0 / batches;
  }
  auto a = ActivationLoad({counts}, tokens, b);
  ASSERT_TRUE(a.ok());
  for (size_t e = 0; e < counts.size(); ++e) EXPECT_NEAR((*a)[0][e], seen[e], 0.01) << e;
}

TEST(ActivationLoadTest, BadInput) {
  EXPECT_EQ(ActivationLoad({{1}}, 0, 4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ActivationLoad({{1}}, 10, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ActivationLoad({{-1}}, 10, 4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ActivationLoad({{11}}, 10, 4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ActivationLoad({{NAN}}, 10, 4).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moerun
