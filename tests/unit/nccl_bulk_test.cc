// The nccl transport's host-side bookkeeping (transport/nccl/nccl_bulk.h) and the launcher's
// one-GPU-per-rank check (launch/local_device.h): everything of --transport nccl that runs
// without a GPU.
#include "transport/nccl/nccl_bulk.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>
#include <vector>

#include "launch/local_device.h"
#include "runtime/ep/protocol.h"

namespace moerun {
namespace {

const std::vector<int> kEpBulkTags = {kTagRows, kTagResult};

TEST(NcclBulkTest, OnlyBulkTagsBetweenTwoRanksGoOverNccl) {
  EXPECT_EQ(PathOf(kEpBulkTags, 0, 1, kTagRows), NcclPath::kNccl);
  EXPECT_EQ(PathOf(kEpBulkTags, 3, 0, kTagResult), NcclPath::kNccl);
  // The protocol's small messages and the reserved collective tags stay on the bootstrap.
  for (const int tag : {kTagHeader, kTagPong, kTagControl, kTagControlBody, kReservedTagBase,
                        kReservedTagBase + 420}) {
    EXPECT_EQ(PathOf(kEpBulkTags, 0, 1, tag), NcclPath::kBootstrap) << tag;
  }
  // A rank's messages to itself follow their tag too.
  EXPECT_EQ(PathOf(kEpBulkTags, 2, 2, kTagRows), NcclPath::kNccl);
  EXPECT_EQ(PathOf(kEpBulkTags, 2, 2, kTagHeader), NcclPath::kBootstrap);
  EXPECT_EQ(PathOf({}, 0, 1, kTagRows), NcclPath::kBootstrap);
}

TEST(NcclBulkTest, EachDirectionOfAPairHasItsOwnCommunicator) {
  EXPECT_EQ(NcclCommOf(0, 1), 0);
  EXPECT_EQ(NcclCommOf(1, 0), 1);
  EXPECT_EQ(NcclCommOf(2, 7), 0);
  EXPECT_EQ(NcclCommOf(7, 2), 1);
  EXPECT_EQ(NcclCommOf(3, 3), 1);  // a send to itself and its receive: one communicator
  // Both sides of one message name the same communicator: the sender's send and the receiver's
  // receive of a message from 2 to 7.
  std::vector<GroupedBulkOp> sender, receiver;
  const BulkOp send{BulkOp::Kind::kSend, 7, 100, 1};
  const BulkOp recv{BulkOp::Kind::kRecv, 2, 100, 1};
  PlanFlush(2, std::span<const BulkOp>(&send, 1), sender);
  PlanFlush(7, std::span<const BulkOp>(&recv, 1), receiver);
  ASSERT_EQ(sender.size(), 1u);
  ASSERT_EQ(receiver.size(), 1u);
  EXPECT_EQ(sender[0].comm, receiver[0].comm);
}

TEST(NcclBulkTest, FlushKeepsTheDecidedOrderOnEachDirectionsCommunicator) {
  // A router (rank 0) dispatching to expert ranks 1..3 (nothing for rank 2) and receiving the
  // results of two of them, in the order they were decided: the dispatch is all on communicator
  // 0 (one group), the results on communicator 1 (another).
  const std::vector<BulkOp> queued = {
      {BulkOp::Kind::kSend, 1, 4096, 10}, {BulkOp::Kind::kSend, 2, 0, 11},
      {BulkOp::Kind::kSend, 3, 512, 12},  {BulkOp::Kind::kRecv, 3, 520, 13},
      {BulkOp::Kind::kRecv, 1, 4104, 14},
  };
  std::vector<GroupedBulkOp> group;
  PlanFlush(0, queued, group);
  const std::vector<GroupedBulkOp> want = {
      {queued[0], 0}, {queued[2], 0}, {queued[3], 1}, {queued[4], 1}};
  EXPECT_EQ(group, want);
  // Reused: cleared first.
  PlanFlush(0, std::span<const BulkOp>(queued.data(), 1), group);
  EXPECT_EQ(group.size(), 1u);
}

TEST(NcclBulkTest, EnvelopeChecks) {
  BulkEnvelope e;
  e.tag = kTagRows;
  e.bytes = 10;
  e.seq = 4;
  EXPECT_TRUE(CheckEnvelope(e, 1, 4, kEpBulkTags).ok());
  const Status gap = CheckEnvelope(e, 1, 3, kEpBulkTags);
  EXPECT_EQ(gap.code(), StatusCode::kCorrupt);
  EXPECT_NE(gap.message().find("rank 1"), std::string::npos) << gap.message();
  e.tag = kTagHeader;
  EXPECT_EQ(CheckEnvelope(e, 1, 4, kEpBulkTags).code(), StatusCode::kCorrupt);
  e.tag = kTagRows;
  e.magic = 0;
  EXPECT_EQ(CheckEnvelope(e, 1, 4, kEpBulkTags).code(), StatusCode::kCorrupt);
}

TEST(NcclBulkTest, MatcherTakesTheFirstPostedReceiveOfTheTag) {
  BulkMatcher m;
  EXPECT_FALSE(m.Post(1, kTagRows, 100));
  EXPECT_FALSE(m.Post(2, kTagResult, 50));
  EXPECT_FALSE(m.Post(3, kTagRows, 200));
  // A result arrives first: it takes receive 2, not the earlier rows receive.
  auto p = m.Arrive(kTagResult, 50, 1000);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->id, 2u);
  p = m.Arrive(kTagRows, 100, 1001);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->id, 1u);
  // The size is the caller's to compare: a 7-byte message still takes receive 3 (200 bytes).
  p = m.Arrive(kTagRows, 7, 1002);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->id, 3u);
  EXPECT_EQ(p->bytes, 200u);
  EXPECT_EQ(m.posted(), 0u);
}

TEST(NcclBulkTest, MatcherKeepsUnexpectedMessagesForLaterReceives) {
  BulkMatcher m;
  EXPECT_FALSE(m.Arrive(kTagRows, 64, 500));
  EXPECT_FALSE(m.Arrive(kTagRows, 32, 501));
  EXPECT_EQ(m.unexpected(), 2u);
  auto u = m.Post(1, kTagResult, 64);  // another tag: waits
  EXPECT_FALSE(u);
  u = m.Post(2, kTagRows, 64);
  ASSERT_TRUE(u);
  EXPECT_EQ(u->handle, 500u);
  EXPECT_EQ(u->bytes, 64u);
  u = m.Post(3, kTagRows, 32);
  ASSERT_TRUE(u);
  EXPECT_EQ(u->handle, 501u);
  EXPECT_EQ(m.unexpected(), 0u);
  EXPECT_EQ(m.posted(), 1u);
}

TEST(NcclBulkTest, WithdrawnReceiveLeavesItsMessageToTheNext) {
  BulkMatcher m;
  EXPECT_FALSE(m.Post(1, kTagRows, 8));
  EXPECT_FALSE(m.Post(2, kTagRows, 8));
  EXPECT_TRUE(m.Withdraw(1));
  EXPECT_FALSE(m.Withdraw(1));
  auto p = m.Arrive(kTagRows, 8, 9);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->id, 2u);
}

// Reference: per tag, the k-th message sent goes to the k-th receive posted, whatever the
// interleaving of arrivals and posts (MPI's non-overtaking rule per (pair, tag)).
TEST(NcclBulkTest, MatcherPairsKthMessageWithKthReceivePerTagInAnyInterleaving) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 20);
    std::vector<int> send_tags(static_cast<size_t>(n)), recv_tags;
    for (int& t : send_tags) t = static_cast<int>(rng() % 3);
    recv_tags = send_tags;
    std::shuffle(recv_tags.begin(), recv_tags.end(), rng);
    // Message i has handle 1000 + i, receive j has id j + 1.
    BulkMatcher m;
    std::map<uint64_t, uint64_t> got;  // receive id -> message handle
    size_t si = 0, ri = 0;
    while (si < send_tags.size() || ri < recv_tags.size()) {
      const bool arrive = ri == recv_tags.size() || (si < send_tags.size() && rng() % 2 == 0);
      if (arrive) {
        const uint64_t h = 1000 + si;
        if (auto p = m.Arrive(send_tags[si], 1, h)) got[p->id] = h;
        ++si;
      } else {
        const uint64_t id = ri + 1;
        if (auto u = m.Post(id, recv_tags[ri], 1)) got[id] = u->handle;
        ++ri;
      }
    }
    ASSERT_EQ(got.size(), send_tags.size());
    EXPECT_EQ(m.posted(), 0u);
    EXPECT_EQ(m.unexpected(), 0u);
    std::map<int, std::vector<uint64_t>> sent_by_tag, recv_by_tag;
    for (size_t i = 0; i < send_tags.size(); ++i) sent_by_tag[send_tags[i]].push_back(1000 + i);
    for (size_t j = 0; j < recv_tags.size(); ++j) recv_by_tag[recv_tags[j]].push_back(j + 1);
    for (const auto& [tag, handles] : sent_by_tag) {
      const std::vector<uint64_t>& ids = recv_by_tag[tag];
      ASSERT_EQ(ids.size(), handles.size());
      for (size_t k = 0; k < ids.size(); ++k) {
        EXPECT_EQ(got[ids[k]], handles[k]) << "trial " << trial << " tag " << tag << " #" << k;
      }
    }
  }
}

TEST(NcclBulkTest, StagingSlotsAreAllocatedOnceAndGrownToTheLargestMessage) {
  constexpr size_t kG = StagingPool::kStagingGranule;
  EXPECT_EQ(StagingPool::CapacityFor(0), kG);
  EXPECT_EQ(StagingPool::CapacityFor(1), kG);
  EXPECT_EQ(StagingPool::CapacityFor(kG), kG);
  EXPECT_EQ(StagingPool::CapacityFor(kG + 1), 2 * kG);
  StagingPool pool;
  StagingPool::Grant a = pool.Acquire(1000);
  EXPECT_TRUE(a.allocate);
  EXPECT_EQ(a.capacity, kG);
  EXPECT_EQ(a.old_capacity, 0u);
  StagingPool::Grant b = pool.Acquire(3 * kG);  // a is busy: a second slot
  EXPECT_NE(b.slot, a.slot);
  EXPECT_TRUE(b.allocate);
  EXPECT_EQ(b.capacity, 3 * kG);
  pool.Release(a.slot);
  pool.Release(b.slot);
  // Steady state: messages up to the largest reuse the slots without allocating; the smallest
  // free slot that fits is taken.
  for (int i = 0; i < 10; ++i) {
    StagingPool::Grant x = pool.Acquire(100);
    EXPECT_FALSE(x.allocate);
    EXPECT_EQ(x.slot, a.slot);
    StagingPool::Grant y = pool.Acquire(2 * kG);
    EXPECT_FALSE(y.allocate);
    EXPECT_EQ(y.slot, b.slot);
    pool.Release(x.slot);
    pool.Release(y.slot);
  }
  // A larger message grows the largest free slot (no third slot).
  StagingPool::Grant c = pool.Acquire(5 * kG);
  EXPECT_TRUE(c.allocate);
  EXPECT_EQ(c.slot, b.slot);
  EXPECT_EQ(c.old_capacity, 3 * kG);
  EXPECT_EQ(c.capacity, 5 * kG);
  EXPECT_EQ(pool.slots(), 2);
  EXPECT_EQ(pool.total_bytes(), 6 * kG);
  EXPECT_TRUE(pool.in_use(c.slot));
  pool.Release(c.slot);
  EXPECT_FALSE(pool.in_use(c.slot));
}

// The launcher's check before anything starts (launch/local_device.h).
EnvLookup NcclEnv(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

TEST(NcclLaunchTest, OneGpuPerLocalRankPasses) {
  for (int r = 0; r < 4; ++r) {
    const LocalDeviceChoice c =
        ChooseLocalDevice(NcclEnv({{"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r)},
                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}),
                          4);
    EXPECT_TRUE(CheckOneGpuPerRank(c).ok()) << CheckOneGpuPerRank(c).ToString();
  }
  // More GPUs than ranks is fine.
  EXPECT_TRUE(CheckOneGpuPerRank(ChooseLocalDevice(NcclEnv({}), 8)).ok());
}

TEST(NcclLaunchTest, FewerGpusThanLocalRanksIsOneLineNamingTheCounts) {
  // Rank 0 of 4 on 2 GPUs: its GPU is shared, whichever rank asks.
  for (int r = 0; r < 4; ++r) {
    const LocalDeviceChoice c =
        ChooseLocalDevice(NcclEnv({{"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r)},
                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                                   {"CUDA_VISIBLE_DEVICES", "2,3"}}),
                          2);
    const Status s = CheckOneGpuPerRank(c);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("4 ranks on this host but 2 GPU(s) visible"), std::string::npos)
        << s.message();
    EXPECT_NE(s.message().find("CUDA_VISIBLE_DEVICES=2,3"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("NCCL refuses two ranks on one GPU"), std::string::npos);
    EXPECT_EQ(s.message().find('\n'), std::string::npos);
  }
  // 3 ranks on 2 GPUs: rank 1 alone on GPU 1 still fails (rank 0 and 2 share GPU 0, and the
  // job's ranks must all agree).
  const LocalDeviceChoice c1 = ChooseLocalDevice(
      NcclEnv({{"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}}), 2);
  EXPECT_FALSE(c1.shared);
  EXPECT_EQ(CheckOneGpuPerRank(c1).code(), StatusCode::kInvalidArgument);
}

TEST(NcclLaunchTest, NoGpuIsInvalidArgument) {
  const Status s = CheckOneGpuPerRank(ChooseLocalDevice(NcclEnv({}), 0));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("no CUDA device visible"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace moerun
