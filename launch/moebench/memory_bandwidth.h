// The machine's memory read bandwidth, measured in the benchmark's own run: every thread of the
// pool streams its share of a buffer much larger than the caches. Used for the physical floor of
// small batches, which are bound by reading expert weights.
#pragma once

#include "base/thread_pool.h"

namespace moerun::bench {

// Bytes per second (best of `reps` passes over `bytes`).
double MeasureReadBandwidth(ThreadPool* pool, size_t bytes = size_t{512} << 20, int reps = 3);

}  // namespace moerun::bench
