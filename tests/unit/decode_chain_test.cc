// moebench decode's pure parts (launch/moebench/decode_chain.h): the micro-batch split, the
// residual chain, the wire rounding, the --layers list and the attention share.
#include "launch/moebench/decode_chain.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "base/dtype.h"

namespace moerun::bench {
namespace {

TEST(DecodeChainTest, SplitCoversEverySequenceOnceInNearlyEqualParts) {
  const auto three = SplitSequences(10, 3);
  ASSERT_EQ(three.size(), 3u);
  EXPECT_EQ(three[0].first, 0);
  EXPECT_EQ(three[0].count, 4);
  EXPECT_EQ(three[1].first, 4);
  EXPECT_EQ(three[1].count, 3);
  EXPECT_EQ(three[2].first, 7);
  EXPECT_EQ(three[2].count, 3);
  for (int64_t s : {1, 2, 7, 64, 1000}) {
    for (int m = 1; m <= 8 && m <= s; ++m) {
      const auto mbs = SplitSequences(s, m);
      ASSERT_EQ(mbs.size(), static_cast<size_t>(m));
      int64_t next = 0, lo = s, hi = 0;
      for (const auto& mb : mbs) {
        EXPECT_EQ(mb.first, next);
        next += mb.count;
        lo = std::min(lo, mb.count);
        hi = std::max(hi, mb.count);
      }
      EXPECT_EQ(next, s);
      EXPECT_LE(hi - lo, 1);
      EXPECT_GE(lo, 1);
    }
  }
  EXPECT_TRUE(SplitSequences(2, 3).empty());  // more micro-batches than sequences
  EXPECT_TRUE(SplitSequences(0, 1).empty());
  EXPECT_TRUE(SplitSequences(4, 0).empty());
}

TEST(DecodeChainTest, NextHiddenIsTheNormalisedResidual) {
  const std::vector<float> x = {1, 1, 1, 1, 0, 0, 0, 0};
  const std::vector<float> y = {1, 1, 1, 1, 3, -3, 3, -3};
  std::vector<float> out(8);
  NextHidden(x.data(), y.data(), 2, 4, out.data());
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(out[static_cast<size_t>(i)], 1.0f, 1e-6f);  // 2 / 2
  EXPECT_NEAR(out[4], 1.0f, 1e-6f);                                                   // 3 / 3
  EXPECT_NEAR(out[5], -1.0f, 1e-6f);
  // A zero row stays zero (the epsilon keeps it finite).
  const std::vector<float> zero(4, 0.0f);
  std::vector<float> z(4, 7.0f);
  NextHidden(zero.data(), zero.data(), 1, 4, z.data());
  for (float v : z) EXPECT_EQ(v, 0.0f);
}

// Over many layers the values stay in range: every row's RMS is 1 after each step.
TEST(DecodeChainTest, FiftyEightLayersStayInRange) {
  const int64_t h = 64;
  std::vector<float> x(2 * h), y(2 * h);
  for (int64_t i = 0; i < 2 * h; ++i) x[static_cast<size_t>(i)] = std::sin(0.1f * i) * 3;
  for (int layer = 0; layer < 58; ++layer) {
    for (int64_t i = 0; i < 2 * h; ++i) {
      y[static_cast<size_t>(i)] = 50.0f * std::cos(0.37f * i + layer);  // a loud layer
    }
    NextHidden(x.data(), y.data(), 2, h, x.data());
    for (int r = 0; r < 2; ++r) {
      double sum = 0;
      for (int64_t i = 0; i < h; ++i)
        sum += x[static_cast<size_t>(r * h + i)] * x[static_cast<size_t>(r * h + i)];
      EXPECT_NEAR(std::sqrt(sum / h), 1.0, 1e-4) << "layer " << layer << " row " << r;
    }
  }
}

// Row by row: a micro-batch's rows flow exactly (bitwise) as in the whole batch.
TEST(DecodeChainTest, RowsFlowAloneAsInTheBatch) {
  const int64_t h = 33, rows = 5;
  std::vector<float> x(rows * h), y(rows * h), whole(rows * h), part(2 * h);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = std::sin(1.3f * static_cast<float>(i));
    y[i] = std::cos(0.7f * static_cast<float>(i)) * 4;
  }
  NextHidden(x.data(), y.data(), rows, h, whole.data());
  NextHidden(x.data() + 2 * h, y.data() + 2 * h, 2, h, part.data());
  EXPECT_EQ(std::memcmp(part.data(), whole.data() + 2 * h, part.size() * sizeof(float)), 0);
}

TEST(DecodeChainTest, WireRoundTrips) {
  const std::vector<float> x = {1.0f, -2.5f, 3.14159265f, 1e-3f};
  const std::string f32 = EncodeWire(x.data(), 4, false);
  ASSERT_EQ(f32.size(), 16u);
  std::vector<float> back(4);
  DecodeWire(f32, false, back.data());
  EXPECT_EQ(back, x);
  const std::string bf16 = EncodeWire(x.data(), 4, true);
  ASSERT_EQ(bf16.size(), 8u);
  DecodeWire(bf16, true, back.data());
  std::vector<float> rounded = x;
  RoundToWire(rounded.data(), 4, true);
  EXPECT_EQ(back, rounded);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(rounded[i], Bf16ToF32(F32ToBf16(x[i])));
  }
  EXPECT_NE(rounded[2], x[2]);  // pi is not a bf16 value
  std::vector<float> same = x;
  RoundToWire(same.data(), 4, false);
  EXPECT_EQ(same, x);
}

TEST(DecodeChainTest, LayerLists) {
  auto a = ParseLayerList("3,5-7,10");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, (std::vector<int>{3, 5, 6, 7, 10}));
  auto b = ParseLayerList("9,0-1");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, (std::vector<int>{0, 1, 9}));
  for (const char* bad : {"", ",", "3,", "a", "-1", "7-5", "3,3", "2-4,4", "1-", "0-99999999"}) {
    auto e = ParseLayerList(bad);
    EXPECT_FALSE(e.ok()) << bad;
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(e.status().message().find("--layers"), std::string::npos) << bad;
  }
}

TEST(DecodeChainTest, AttentionShare) {
  EXPECT_EQ(AttentionTime(1000, 3, 10).count(), 300);
  EXPECT_EQ(AttentionTime(1000, 10, 10).count(), 1000);
  EXPECT_EQ(AttentionTime(100, 1, 3).count(), 33);
  EXPECT_EQ(AttentionTime(0, 5, 10).count(), 0);
}

}  // namespace
}  // namespace moerun::bench
