// The one clock of moerun's deadlines: every wait (transports, watchdogs, the serving path's
// request deadlines) takes an absolute time point of the steady clock, so that a deadline passed
// down through several calls is never stretched. Header-only, no state.
#pragma once

#include <chrono>

namespace moerun {

using SteadyClock = std::chrono::steady_clock;
using Deadline = SteadyClock::time_point;

inline Deadline DeadlineIn(std::chrono::milliseconds ms) { return SteadyClock::now() + ms; }

// Seconds from `t` to now (for logs and metrics).
inline double SecondsSince(SteadyClock::time_point t) {
  return std::chrono::duration<double>(SteadyClock::now() - t).count();
}

}  // namespace moerun
