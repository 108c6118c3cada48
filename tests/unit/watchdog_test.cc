#include "base/watchdog.h"

#include <gtest/gtest.h>

#include <chrono>

namespace moerun {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

TEST(WatchdogTest, DoneAtOnceDoesNotAbort) {
  int polls = 0, aborts = 0;
  const Status s = WaitWithWatchdog(
      [&]() -> Result<bool> {
        ++polls;
        return true;
      },
      Clock::now() + milliseconds(1000), [&] { ++aborts; }, "op");
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(polls, 1);
  EXPECT_EQ(aborts, 0);
}

TEST(WatchdogTest, PollsAtLeastOnceEvenPastTheDeadline) {
  int polls = 0, aborts = 0;
  const Status s = WaitWithWatchdog(
      [&]() -> Result<bool> {
        ++polls;
        return true;
      },
      Clock::now() - milliseconds(10), [&] { ++aborts; }, "op");
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(polls, 1);
  EXPECT_EQ(aborts, 0);
}

TEST(WatchdogTest, DoneAfterSeveralPolls) {
  int polls = 0, aborts = 0;
  const Status s = WaitWithWatchdog([&]() -> Result<bool> { return ++polls == 5000; },
                                    Clock::now() + milliseconds(20000), [&] { ++aborts; }, "op",
                                    /*idle_spins=*/10);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(polls, 5000);
  EXPECT_EQ(aborts, 0);
}

TEST(WatchdogTest, ErrorAbortsOnceAndIsReturned) {
  int polls = 0, aborts = 0;
  const Status s = WaitWithWatchdog(
      [&]() -> Result<bool> {
        if (++polls < 3) return false;
        return Status::Unavailable("remote error");
      },
      Clock::now() + milliseconds(20000), [&] { ++aborts; }, "nccl exchange");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "nccl exchange: remote error");
  EXPECT_EQ(polls, 3);
  EXPECT_EQ(aborts, 1);
}

TEST(WatchdogTest, DeadlineAbortsOnceAndNamesTheOperation) {
  int polls = 0, aborts = 0;
  const auto start = Clock::now();
  const Status s = WaitWithWatchdog(
      [&]() -> Result<bool> {
        ++polls;
        return false;
      },
      start + milliseconds(50), [&] { ++aborts; }, "nccl init");
  const auto took = Clock::now() - start;
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("nccl init"), std::string::npos) << s.message();
  EXPECT_EQ(aborts, 1);
  EXPECT_GE(polls, 1);
  EXPECT_GE(took, milliseconds(50));
  EXPECT_LT(took, milliseconds(5000));  // never hangs
}

TEST(WatchdogTest, NeverDonePastDeadlineReturnsAtOnce) {
  int aborts = 0;
  const auto start = Clock::now();
  const Status s = WaitWithWatchdog([]() -> Result<bool> { return false; }, start - milliseconds(1),
                                    [&] { ++aborts; }, "op", 0);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(aborts, 1);
  EXPECT_LT(Clock::now() - start, milliseconds(1000));
}

}  // namespace
}  // namespace moerun
