// The router's sliding-window load statistics (router/load_window.h), with time driven by the
// test: what is inside the window counts, what has left it does not, balancedness = mean / max.
#include "router/load_window.h"

#include <gtest/gtest.h>

namespace moerun {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

TEST(LoadWindowTest, CountsWhatIsInsideTheWindow) {
  LoadWindow w(4, 2, seconds(60), 12);  // 5 s buckets
  const auto t0 = LoadWindow::Clock::now();
  const std::vector<uint64_t> e1 = {10, 0, 0, 2}, r1 = {10, 2};
  w.Add(e1, r1, t0);
  w.Add(e1, r1, t0 + seconds(1));
  EXPECT_EQ(w.ExpertLoad(t0 + seconds(2)), (std::vector<uint64_t>{20, 0, 0, 4}));
  EXPECT_EQ(w.RankLoad(t0 + seconds(2)), (std::vector<uint64_t>{20, 4}));
  EXPECT_EQ(w.Total(t0 + seconds(2)), 24u);
  EXPECT_DOUBLE_EQ(w.Balancedness(t0 + seconds(2)), 12.0 / 20.0);
  // 30 s later more load on rank 1: both in the window.
  const std::vector<uint64_t> e2 = {0, 16, 0, 0}, r2 = {0, 16};
  w.Add(e2, r2, t0 + seconds(30));
  EXPECT_EQ(w.RankLoad(t0 + seconds(31)), (std::vector<uint64_t>{20, 20}));
  EXPECT_DOUBLE_EQ(w.Balancedness(t0 + seconds(31)), 1.0);
  // 70 s after the start the first adds have left the window; the second has not.
  EXPECT_EQ(w.RankLoad(t0 + seconds(70)), (std::vector<uint64_t>{0, 16}));
  EXPECT_DOUBLE_EQ(w.Balancedness(t0 + seconds(70)), 0.5);
  // And after two windows, nothing.
  EXPECT_EQ(w.Total(t0 + seconds(200)), 0u);
  EXPECT_DOUBLE_EQ(w.Balancedness(t0 + seconds(200)), 1.0);
}

// A dead expert rank (no load) is left out of the balancedness when asked.
TEST(LoadWindowTest, BalancednessWithoutSkippedRanks) {
  LoadWindow w(4, 3, seconds(60), 12);
  const auto t0 = LoadWindow::Clock::now();
  const std::vector<uint64_t> e = {10, 10, 0, 0}, r = {10, 0, 10};
  w.Add(e, r, t0);
  EXPECT_DOUBLE_EQ(w.Balancedness(t0), 20.0 / 3.0 / 10.0);
  EXPECT_DOUBLE_EQ(w.Balancedness(t0, {false, true, false}), 1.0);
  EXPECT_DOUBLE_EQ(w.Balancedness(t0, {true}), 0.5);              // shorter: the rest are kept
  EXPECT_DOUBLE_EQ(w.Balancedness(t0, {true, true, true}), 1.0);  // none left: 1
  EXPECT_DOUBLE_EQ(w.Balancedness(t0), 20.0 / 3.0 / 10.0);        // the counts are untouched
}

TEST(LoadWindowTest, ReusedBucketsStartOver) {
  LoadWindow w(1, 1, milliseconds(1000), 4);  // 250 ms buckets, ring of 4
  const auto t0 = LoadWindow::Clock::now();
  const std::vector<uint64_t> one = {1};
  for (int i = 0; i < 40; ++i) w.Add(one, one, t0 + milliseconds(100 * i));  // 10 per second
  // At 4 s the window holds the adds of (3.0 s, 4 s]: between 7 and 10 of them.
  const uint64_t total = w.Total(t0 + milliseconds(3950));
  EXPECT_GE(total, 7u);
  EXPECT_LE(total, 10u);
}

TEST(LoadWindowTest, MeanOverMax) {
  EXPECT_DOUBLE_EQ(MeanOverMax(std::vector<uint64_t>{}), 1.0);
  EXPECT_DOUBLE_EQ(MeanOverMax(std::vector<uint64_t>{0, 0}), 1.0);
  EXPECT_DOUBLE_EQ(MeanOverMax(std::vector<uint64_t>{30, 10, 10, 10}), 15.0 / 30.0);
  // Shorter inputs than the window's sizes add what they have.
  LoadWindow w(3, 3, milliseconds(1000));
  const auto t = LoadWindow::Clock::now();
  w.Add(std::vector<uint64_t>{5}, std::vector<uint64_t>{5}, t);
  EXPECT_EQ(w.ExpertLoad(t), (std::vector<uint64_t>{5, 0, 0}));
}

}  // namespace
}  // namespace moerun
