#include "launch/moebench/memory_bandwidth.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

#include "base/aligned_buffer.h"

namespace moerun::bench {

double MeasureReadBandwidth(ThreadPool* pool, size_t bytes, int reps) {
  AlignedBuffer buf(bytes);
  const size_t words = bytes / sizeof(uint64_t);
  uint64_t* w = buf.as<uint64_t>();
  constexpr int64_t kChunks = 256;
  const size_t per = words / kChunks;
  pool->ParallelFor(kChunks, [&](int64_t c, int) {
    for (size_t i = c * per; i < (c + 1) * per; ++i) w[i] = i;  // touch every page
  });
  std::atomic<uint64_t> sink{0};
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool->ParallelFor(kChunks, [&](int64_t c, int) {
      uint64_t s = 0;
      const uint64_t* p = w + c * per;
      for (size_t i = 0; i < per; ++i) s += p[i];  // integer sum: vectorises, no FP reordering
      sink += s;
    });
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(per * kChunks * sizeof(uint64_t)) / sec);
  }
  return sink.load() == 42 ? best + 1 : best;  // keep the sums alive
}

}  // namespace moerun::bench
