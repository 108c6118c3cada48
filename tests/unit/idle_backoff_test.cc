#include "base/idle_backoff.h"

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

namespace moerun {
namespace {

using std::chrono::microseconds;

TEST(IdlePolicyTest, ACoreForEachRankKeepsTheShortSleep) {
  const IdlePolicy p = IdlePolicyFor(/*local_ranks=*/8, /*cores=*/16, nullptr);
  EXPECT_EQ(p.sleep_cap, microseconds(50));
  EXPECT_EQ(p.yields, 18000u);
  EXPECT_EQ(IdlePolicyFor(0, 2, nullptr).sleep_cap, microseconds(50));  // launcher unknown
  EXPECT_EQ(IdlePolicyFor(2, 2, "").sleep_cap, microseconds(50));
}

TEST(IdlePolicyTest, MoreRanksThanCoresSleepLongerAndYieldLess) {
  const IdlePolicy p = IdlePolicyFor(64, 2, nullptr);
  EXPECT_EQ(p.sleep_cap, microseconds(1000));
  EXPECT_LT(p.yields, 18000u);
  EXPECT_LE(p.max_spins, 16u);
  EXPECT_EQ(IdlePolicyFor(8, 16, nullptr).max_spins, UINT64_MAX);
}

TEST(IdleBackoffTest, AnOversubscribedLoopSleepsOnceIdleLongEnoughWhateverThePasses) {
  IdlePolicy p = IdlePolicyFor(64, 2, nullptr);
  p.yields = 1000000;  // passes alone would never get there
  IdleBackoff b(/*spins=*/0, p);
  const auto t0 = std::chrono::steady_clock::now();
  while (b.next_sleep() == microseconds(50) &&
         std::chrono::steady_clock::now() - t0 < 20 * p.busy_for) {
    b.Idle();  // yields until idle for busy_for, then the first sleep
  }
  EXPECT_GE(std::chrono::steady_clock::now() - t0, p.busy_for);
  EXPECT_EQ(b.next_sleep(), microseconds(100));
  b.Progress();
  EXPECT_EQ(b.next_sleep(), microseconds(50));
}

TEST(IdleBackoffTest, AnOversubscribedHostCapsTheLoopsSpins) {
  IdlePolicy p = IdlePolicyFor(64, 2, nullptr);
  p.yields = 0;
  IdleBackoff b(/*spins=*/2000, p);
  for (uint64_t i = 0; i < p.max_spins; ++i) b.Idle();
  EXPECT_EQ(b.next_sleep(), microseconds(50));
  b.Idle();  // the first sleep, long before 2000 passes
  EXPECT_EQ(b.next_sleep(), microseconds(100));
}

TEST(IdlePolicyTest, TheEnvironmentOverridesWithinRange) {
  EXPECT_EQ(IdlePolicyFor(8, 16, "2000").sleep_cap, microseconds(2000));
  EXPECT_EQ(IdlePolicyFor(64, 2, "50").sleep_cap, microseconds(50));
  // Out of range or not a number: ignored.
  EXPECT_EQ(IdlePolicyFor(64, 2, "10").sleep_cap, microseconds(1000));
  EXPECT_EQ(IdlePolicyFor(64, 2, "200000").sleep_cap, microseconds(1000));
  EXPECT_EQ(IdlePolicyFor(8, 16, "1ms").sleep_cap, microseconds(50));
}

TEST(IdleBackoffTest, SpinsThenYieldsThenSleepsDoublingUpToTheCap) {
  IdlePolicy p;
  p.sleep_cap = microseconds(400);
  p.yields = 3;
  IdleBackoff b(/*spins=*/5, p);
  for (int i = 0; i < 5 + 3; ++i) b.Idle();  // spins and yields: no sleep yet
  EXPECT_EQ(b.next_sleep(), microseconds(50));
  const microseconds want[] = {microseconds(100), microseconds(200), microseconds(400),
                               microseconds(400)};
  for (microseconds w : want) {
    const auto t0 = std::chrono::steady_clock::now();
    b.Idle();
    EXPECT_GE(std::chrono::steady_clock::now() - t0, microseconds(40));  // it slept
    EXPECT_EQ(b.next_sleep(), w);
  }
  b.Progress();
  EXPECT_EQ(b.next_sleep(), microseconds(50));
  const auto t0 = std::chrono::steady_clock::now();
  b.Idle();  // spinning again: returns at once (generous bound for a loaded machine)
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(40));
}

// A waiter that records its waits and wakes when told to (never sleeps).
class FakeWaiter : public IdleWaiter {
 public:
  explicit FakeWaiter(bool wakes) : wakes_(wakes) {}
  bool WaitForActivity(microseconds max) override {
    waits.push_back(max);
    const bool w = wake_next;
    wake_next = false;
    return w;
  }
  bool wakes_on_arrival() const override { return wakes_; }
  std::vector<microseconds> waits;
  bool wake_next = false;

 private:
  bool wakes_;
};

TEST(IdleBackoffTest, AWaiterThatWakesOnArrivalTakesTheSleepsAndAWakeStartsSpinningAgain) {
  IdlePolicy p;
  p.sleep_cap = microseconds(400);
  p.yields = 2;
  FakeWaiter w(/*wakes=*/true);
  IdleBackoff b(/*spins=*/3, p, &w);
  for (int i = 0; i < 3 + 2; ++i) b.Idle();  // spins and yields
  EXPECT_TRUE(w.waits.empty());
  b.Idle();
  b.Idle();
  ASSERT_EQ(w.waits.size(), 2u);  // blocked, not slept, doubling as the sleeps did
  EXPECT_EQ(w.waits[0], microseconds(50));
  EXPECT_EQ(w.waits[1], microseconds(100));
  w.wake_next = true;
  b.Idle();  // woken: spinning again
  EXPECT_EQ(b.next_sleep(), microseconds(50));
  for (int i = 0; i < 3 + 2; ++i) b.Idle();
  EXPECT_EQ(w.waits.size(), 3u);  // no wait while spinning and yielding again
  b.Idle();
  EXPECT_EQ(w.waits.size(), 4u);
  EXPECT_EQ(w.waits[3], microseconds(50));
}

TEST(IdleBackoffTest, AWaiterThatCannotWakeIsNotUsed) {
  IdlePolicy p;
  p.yields = 0;
  FakeWaiter w(/*wakes=*/false);
  IdleBackoff b(/*spins=*/0, p, &w);
  const auto t0 = std::chrono::steady_clock::now();
  b.Idle();
  EXPECT_TRUE(w.waits.empty());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, microseconds(40));  // it slept
}

}  // namespace
}  // namespace moerun
