// Load over a sliding window: (token, expert) assignments per logical expert and per expert rank
// in the last `window`, kept as a ring of time buckets (the window moves one bucket at a time,
// so a total covers between window - bucket and window). The planner reads the per-expert loads;
// balancedness = mean / max assignments per expert rank (1 = even; 1 with no load).
// Time is passed in (tests drive it). Not thread-safe: one owner (the router thread) updates it;
// readers take a copy under the owner's lock.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

namespace moerun {

class LoadWindow {
 public:
  using Clock = std::chrono::steady_clock;

  // experts: logical experts of the layer; ranks: expert ranks (the caller maps rank numbers).
  LoadWindow(int experts, int ranks, std::chrono::milliseconds window, int buckets = 12);

  // Adds assignments observed at `now` (sizes: experts and ranks; shorter spans add nothing
  // beyond their length).
  void Add(std::span<const uint64_t> per_expert, std::span<const uint64_t> per_rank,
           Clock::time_point now);

  std::vector<uint64_t> ExpertLoad(Clock::time_point now) const;
  std::vector<uint64_t> RankLoad(Clock::time_point now) const;
  // These two allocate nothing (the serving loop refreshes its gauges with them).
  uint64_t Total(Clock::time_point now) const;
  double Balancedness(Clock::time_point now) const;
  // The same over the expert ranks whose `skip` entry is not set (dead ranks left out).
  double Balancedness(Clock::time_point now, const std::vector<bool>& skip) const;
  std::chrono::milliseconds window() const { return window_; }

 private:
  struct Bucket {
    int64_t epoch = -1;  // which bucket interval it holds (-1: none yet)
    std::vector<uint64_t> experts, ranks;
  };
  int64_t EpochOf(Clock::time_point t) const;
  bool Live(const Bucket& b, Clock::time_point now) const;
  // Per entry, the total over the live buckets of one of their count vectors.
  std::vector<uint64_t> Sum(std::vector<uint64_t> Bucket::*counts, Clock::time_point now) const;

  std::chrono::milliseconds window_, bucket_;
  Clock::time_point origin_;
  std::vector<Bucket> ring_;
  mutable std::vector<uint64_t> rank_sum_;  // Balancedness's scratch
};

// mean / max of the loads (1 when all are zero or there are none).
double MeanOverMax(std::span<const uint64_t> loads);

}  // namespace moerun
