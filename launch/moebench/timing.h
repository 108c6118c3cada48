// Timing helpers for benchmarks: run a callable until both a minimum count and a minimum time
// are reached, and report the median (robust on noisy shared machines).
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace moerun::bench {

// The middle value (the upper one of an even count); 0 for none.
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Timing {
  double median_ms = 0;
  double min_ms = 0;
  int reps = 0;
};

inline Timing TimeIt(const std::function<void()>& fn, int min_reps, double min_seconds,
                     int max_reps = 1000) {
  using clock = std::chrono::steady_clock;
  std::vector<double> ms;
  const auto start = clock::now();
  while (static_cast<int>(ms.size()) < max_reps) {
    const auto t0 = clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
    const double total = std::chrono::duration<double>(clock::now() - start).count();
    if (static_cast<int>(ms.size()) >= min_reps && total >= min_seconds) break;
  }
  std::sort(ms.begin(), ms.end());
  return Timing{ms[ms.size() / 2], ms.front(), static_cast<int>(ms.size())};
}

}  // namespace moerun::bench
