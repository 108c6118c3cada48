// This process's resident memory (Linux: /proc/self/statm), for the load logs that show what a
// rank's weights cost. 0 where it cannot be read. Thread-safe.
#pragma once

#include <cstddef>

namespace moerun {

size_t ResidentBytes();

}  // namespace moerun
