// This process's resident memory (Linux: /proc/self/statm), for the load logs that show what a
// rank's weights cost and the tests that check it. A read that fails is an error, never 0: a
// resident set of 0 would pass every "grew by at most" check. Thread-safe.
#pragma once

#include <cstddef>

#include "base/status.h"

namespace moerun {

// Resident bytes of this process: /proc/self/statm's second field times the page size.
Result<size_t> ResidentBytes();
// The same from a statm file at `path` (/proc/PID/statm; tests give it bad files): IoError if it
// cannot be opened or read, Corrupt if it does not hold two page counts with a resident count
// > 0. Allocates nothing unless it fails (the probes call it on every pong).
Result<size_t> ResidentBytesFrom(const char* path);

}  // namespace moerun
