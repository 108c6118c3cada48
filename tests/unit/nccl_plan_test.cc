#include "transport/nccl/nccl_plan.h"

#include <gtest/gtest.h>

#include <vector>

namespace moerun {
namespace {

using Kind = PeerTransfer::Kind;

TEST(NcclPlanTest, SendsAndReceivesOfNonEmptyPeersInPeerOrder) {
  // 3 ranks: send 10 B to rank 0, nothing to 1, 5 B to 2; receive 0, 7, 3 B.
  const std::vector<int64_t> send = {0, 10, 10, 15};
  const std::vector<int64_t> recv = {4, 4, 11, 14};
  std::vector<PeerTransfer> plan;
  ASSERT_TRUE(PlanGroupedTransfers(3, send, recv, plan).ok());
  const std::vector<PeerTransfer> want = {
      {Kind::kSend, 0, 0, 10},
      {Kind::kRecv, 1, 4, 7},
      {Kind::kSend, 2, 10, 5},
      {Kind::kRecv, 2, 11, 3},
  };
  EXPECT_EQ(plan, want);
}

TEST(NcclPlanTest, SelfIsAPeerLikeAnyOther) {
  const std::vector<int64_t> off = {0, 1 << 20};
  std::vector<PeerTransfer> plan;
  ASSERT_TRUE(PlanGroupedTransfers(1, off, off, plan).ok());
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0], (PeerTransfer{Kind::kSend, 0, 0, 1 << 20}));
  EXPECT_EQ(plan[1], (PeerTransfer{Kind::kRecv, 0, 0, 1 << 20}));
}

TEST(NcclPlanTest, ZeroSizeExchangeHasNoTransfers) {
  const std::vector<int64_t> off = {0, 0, 0, 0, 0};
  std::vector<PeerTransfer> plan = {{Kind::kSend, 9, 9, 9}};  // cleared
  ASSERT_TRUE(PlanGroupedTransfers(4, off, off, plan).ok());
  EXPECT_TRUE(plan.empty());
}

TEST(NcclPlanTest, ReusesCapacity) {
  const std::vector<int64_t> off = {0, 1, 2, 3, 4};
  std::vector<PeerTransfer> plan;
  ASSERT_TRUE(PlanGroupedTransfers(4, off, off, plan).ok());
  const PeerTransfer* data = plan.data();
  ASSERT_TRUE(PlanGroupedTransfers(4, off, off, plan).ok());
  EXPECT_EQ(plan.data(), data);
  EXPECT_EQ(plan.size(), 8u);
}

TEST(NcclPlanTest, BadOffsetsAreClearErrors) {
  std::vector<PeerTransfer> plan;
  const std::vector<int64_t> ok = {0, 1, 2};
  // Wrong size.
  Status s = PlanGroupedTransfers(2, std::vector<int64_t>{0, 1}, ok, plan);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("send offsets: 2 offsets, want ranks + 1 = 3"), std::string::npos)
      << s.message();
  // Decreasing.
  s = PlanGroupedTransfers(2, ok, std::vector<int64_t>{0, 5, 4}, plan);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("receive offsets: offset[2] = 4 is below offset[1] = 5"),
            std::string::npos)
      << s.message();
  // Negative.
  s = PlanGroupedTransfers(2, std::vector<int64_t>{-1, 0, 1}, ok, plan);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("negative"), std::string::npos) << s.message();
  // No ranks.
  s = PlanGroupedTransfers(0, std::vector<int64_t>{0}, std::vector<int64_t>{0}, plan);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(plan.empty());
}

}  // namespace
}  // namespace moerun
