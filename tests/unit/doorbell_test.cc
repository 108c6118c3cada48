#include "transport/doorbell.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace moerun {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::microseconds;
using std::chrono::milliseconds;

TEST(DoorbellTest, NamesCarryTheHostAndAreUnique) {
  Result<Doorbell> a = Doorbell::Open();
  Result<Doorbell> b = Doorbell::Open();
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_NE(a->name(), b->name());
  EXPECT_FALSE(DoorbellHost(a->name()).empty());
  EXPECT_EQ(DoorbellHost(a->name()), DoorbellHost(b->name()));
  EXPECT_LT(a->name().size(), Doorbell::kNameBytes);
  EXPECT_EQ(DoorbellHost("not-a-bell"), "");
  EXPECT_EQ(DoorbellHost("moerun-bell//1/2"), "");
}

// A peer whose asleep word cannot be mapped (b's name is gone before a maps it) is rung always:
// a ring before its wait stays queued and ends the wait at once.
TEST(DoorbellTest, ARingEndsAWaitAtOnceAndARingBeforeTheWaitIsNotLost) {
  Result<Doorbell> a = Doorbell::Open();
  Result<Doorbell> b = Doorbell::Open();
  ASSERT_TRUE(a.ok() && b.ok());
  b->Unlink();
  a->SetPeers({a->name(), b->name()});
  b->SetPeers({a->name(), b->name()});
  EXPECT_EQ(a->ringable(), 1);  // not itself
  // Rung before the wait: returns at once.
  a->Ring(1);
  auto t0 = Clock::now();
  EXPECT_TRUE(b->Wait(microseconds(2'000'000)));
  EXPECT_LT(Clock::now() - t0, milliseconds(500));
  // Drained: the next wait times out.
  t0 = Clock::now();
  EXPECT_FALSE(b->Wait(microseconds(20'000)));
  EXPECT_GE(Clock::now() - t0, milliseconds(15));
  // Rung during the wait, from another thread.
  std::thread ringer([&] {
    std::this_thread::sleep_for(milliseconds(20));
    a->Ring(1);
  });
  t0 = Clock::now();
  b->Wait(microseconds(5'000'000));
  const auto waited = Clock::now() - t0;
  ringer.join();
  EXPECT_LT(waited, milliseconds(2000));
  EXPECT_EQ(a->ring_failures(), 0u);
}

// A peer that is awake (not in Wait) is not rung: it sees the message without a system call.
// One in Wait is; and a recheck that finds something ends the wait before any ring.
TEST(DoorbellTest, OnlyAPeerAsleepIsRungAndARecheckEndsTheWait) {
  Result<Doorbell> a = Doorbell::Open();
  Result<Doorbell> b = Doorbell::Open();
  ASSERT_TRUE(a.ok() && b.ok());
  a->SetPeers({a->name(), b->name()});
  b->SetPeers({a->name(), b->name()});
  a->Unlink();
  b->Unlink();  // mapped already: the words stay shared
  a->Ring(1);
  EXPECT_EQ(a->rings_sent(), 0u);
  EXPECT_EQ(a->rings_skipped_awake(), 1u);
  std::thread ringer([&] {
    std::this_thread::sleep_for(milliseconds(50));  // b is asleep by now
    a->Ring(1, Clock::now() + Doorbell::kCoalesce * 4);
  });
  auto t0 = Clock::now();
  EXPECT_TRUE(b->Wait(microseconds(10'000'000)));
  EXPECT_LT(Clock::now() - t0, milliseconds(5000));
  ringer.join();
  EXPECT_EQ(a->rings_sent(), 1u);
  // Awake again: no ring.
  a->Ring(1, Clock::now() + Doorbell::kCoalesce * 8);
  EXPECT_EQ(a->rings_sent(), 1u);
  t0 = Clock::now();
  EXPECT_TRUE(b->Wait(microseconds(10'000'000), [] { return true; }));
  EXPECT_LT(Clock::now() - t0, milliseconds(5000));
}

TEST(DoorbellTest, RingsInQuickSuccessionToOnePeerAreOne) {
  Result<Doorbell> a = Doorbell::Open();
  Result<Doorbell> b = Doorbell::Open();
  ASSERT_TRUE(a.ok() && b.ok());
  b->Unlink();
  a->SetPeers({a->name(), b->name()});
  const auto t0 = Clock::now();
  a->Ring(1, t0);
  a->Ring(1, t0 + Doorbell::kCoalesce / 2);  // a header and its rows: one ring
  EXPECT_EQ(a->rings_sent(), 1u);
  a->Ring(1, t0 + Doorbell::kCoalesce * 2);
  EXPECT_EQ(a->rings_sent(), 2u);
}

TEST(DoorbellTest, PeersOnAnotherHostOrWithoutABellAreNeverRung) {
  Result<Doorbell> a = Doorbell::Open();
  ASSERT_TRUE(a.ok());
  a->SetPeers({a->name(), "moerun-bell/some-other-host/12/00ff", "", "garbage"});
  EXPECT_EQ(a->ringable(), 0);
  for (int p = -1; p < 6; ++p) a->Ring(p);
  EXPECT_EQ(a->rings_sent(), 0u);
}

TEST(DoorbellTest, ABellWhoseProcessIsGoneFailsTheRingQuietly) {
  Result<Doorbell> a = Doorbell::Open();
  ASSERT_TRUE(a.ok());
  std::string gone;
  {
    Result<Doorbell> b = Doorbell::Open();
    ASSERT_TRUE(b.ok());
    gone = b->name();
  }
  a->SetPeers({a->name(), gone});
  a->Ring(1);
  EXPECT_EQ(a->rings_sent(), 1u);
  EXPECT_EQ(a->ring_failures(), 1u);
}

}  // namespace
}  // namespace moerun
