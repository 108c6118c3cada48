// The machine's memory read bandwidth, measured in the benchmark's own run: the physical floor of
// small batches, which are bound by reading expert weights. A floor must be the best the machine
// gives (else `x_floor` < 1 flatters the layer), so every thread of the benchmark's pool streams
// its share of a buffer far beyond the last-level cache with a tuned read kernel (several
// streams and accumulators, software prefetch), once per vector ISA the CPU runs natively, and
// the fastest pass of any variant is the floor's bandwidth.
//
// Thread-safety: the functions share nothing; one measurement at a time per pool (ThreadPool).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/thread_pool.h"
#include "experts/cpu/isa.h"

namespace moerun::bench {

// The wrapping sum (mod 2^64) of words[0, n), read by the kernel of `isa`. Integer adds commute,
// so every variant returns exactly the plain loop's sum: the check that a kernel reads every word
// once. `isa` must be one this CPU runs (SupportedIsas()); `words` needs no alignment.
uint64_t ReadSum(Isa isa, const uint64_t* words, size_t n);

// One pass of `isa`'s kernel over words[0, n) on every thread of `pool`, in tasks of a few MiB.
struct ReadPass {
  uint64_t sum = 0;  // wrapping sum of all the words (as ReadSum)
  size_t bytes = 0;  // bytes the tasks read: n * 8 when the tasks cover the buffer exactly once
};
ReadPass ReadAll(ThreadPool* pool, Isa isa, const uint64_t* words, size_t n);

// The default buffer: at least 512 MiB and 8 x the last-level cache, so that no pass is served
// from a cache.
size_t DefaultReadBufferBytes();

struct ReadVariantRate {
  Isa isa = Isa::kScalar;
  double bytes_per_s = 0;  // its best pass
};

struct ReadBandwidth {
  double bytes_per_s = 0;                 // the best pass of any variant: the floor's bandwidth
  Isa best = Isa::kScalar;                // the variant that gave it
  std::vector<ReadVariantRate> variants;  // every variant this CPU runs, scalar first
  int threads = 0;                        // the pool's threads (the benchmark's own)
  size_t buffer_bytes = 0;
  int reps = 0;            // passes per variant (interleaved, so noise hits every variant alike)
  bool sums_agree = true;  // every pass of every variant summed the buffer to the same value
};

// Measures every variant this CPU runs on `pool`'s threads: best of `reps` passes over `bytes`.
ReadBandwidth MeasureReadBandwidth(ThreadPool* pool, size_t bytes = DefaultReadBufferBytes(),
                                   int reps = 10);

}  // namespace moerun::bench
