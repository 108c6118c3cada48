#include "base/watchdog.h"

#include <cstdint>
#include <string>

#include "base/idle_backoff.h"

namespace moerun {

Status WaitWithWatchdog(FunctionRef<Result<bool>()> poll, WatchdogDeadline deadline,
                        FunctionRef<void()> on_abort, std::string_view what, int idle_spins) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  IdleBackoff idle(idle_spins > 0 ? static_cast<uint64_t>(idle_spins) : 0);
  while (true) {
    Result<bool> done = poll();
    if (!done.ok()) {
      on_abort();
      return done.status().WithContext(std::string(what));
    }
    if (*done) return Status::Ok();
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      on_abort();
      const auto waited =
          std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count();
      return Status::DeadlineExceeded(std::string(what) +
                                      ": not done before the deadline (waited " +
                                      std::to_string(waited) + " ms); aborted");
    }
    // Spin briefly for latency, then hand the core to whoever must make progress.
    idle.Idle();
  }
}

}  // namespace moerun
