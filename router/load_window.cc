#include "router/load_window.h"

#include <algorithm>

namespace moerun {

LoadWindow::LoadWindow(int experts, int ranks, std::chrono::milliseconds window, int buckets)
    : window_(std::max(window, std::chrono::milliseconds(1))),
      bucket_(std::max<std::chrono::milliseconds::rep>(1, window_.count() / std::max(buckets, 1))),
      origin_(Clock::now() - std::chrono::hours(24 * 365)),
      ring_(static_cast<size_t>(std::max(buckets, 1))) {
  for (Bucket& b : ring_) {
    b.experts.assign(static_cast<size_t>(std::max(experts, 0)), 0);
    b.ranks.assign(static_cast<size_t>(std::max(ranks, 0)), 0);
  }
}

int64_t LoadWindow::EpochOf(Clock::time_point t) const {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t - origin_).count() /
         bucket_.count();
}

bool LoadWindow::Live(const Bucket& b, Clock::time_point now) const {
  return b.epoch >= 0 && b.epoch > EpochOf(now) - static_cast<int64_t>(ring_.size());
}

void LoadWindow::Add(std::span<const uint64_t> per_expert, std::span<const uint64_t> per_rank,
                     Clock::time_point now) {
  const int64_t epoch = EpochOf(now);
  Bucket& b = ring_[static_cast<size_t>(epoch % static_cast<int64_t>(ring_.size()))];
  if (b.epoch != epoch) {  // a bucket interval that has left the window: start it over
    std::fill(b.experts.begin(), b.experts.end(), 0);
    std::fill(b.ranks.begin(), b.ranks.end(), 0);
    b.epoch = epoch;
  }
  for (size_t i = 0; i < per_expert.size() && i < b.experts.size(); ++i)
    b.experts[i] += per_expert[i];
  for (size_t i = 0; i < per_rank.size() && i < b.ranks.size(); ++i) b.ranks[i] += per_rank[i];
}

std::vector<uint64_t> LoadWindow::Sum(std::vector<uint64_t> Bucket::*counts,
                                      Clock::time_point now) const {
  std::vector<uint64_t> out((ring_.front().*counts).size(), 0);
  for (const Bucket& b : ring_) {
    if (!Live(b, now)) continue;
    for (size_t i = 0; i < out.size(); ++i) out[i] += (b.*counts)[i];
  }
  return out;
}

std::vector<uint64_t> LoadWindow::ExpertLoad(Clock::time_point now) const {
  return Sum(&Bucket::experts, now);
}

std::vector<uint64_t> LoadWindow::RankLoad(Clock::time_point now) const {
  return Sum(&Bucket::ranks, now);
}

uint64_t LoadWindow::Total(Clock::time_point now) const {
  uint64_t t = 0;
  for (const Bucket& b : ring_) {
    if (!Live(b, now)) continue;
    for (uint64_t v : b.experts) t += v;
  }
  return t;
}

double LoadWindow::Balancedness(Clock::time_point now) const { return Balancedness(now, {}); }

double LoadWindow::Balancedness(Clock::time_point now, const std::vector<bool>& skip) const {
  rank_sum_.assign(ring_.front().ranks.size(), 0);
  for (const Bucket& b : ring_) {
    if (!Live(b, now)) continue;
    for (size_t i = 0; i < rank_sum_.size(); ++i) rank_sum_[i] += b.ranks[i];
  }
  size_t kept = 0;
  for (size_t i = 0; i < rank_sum_.size(); ++i) {
    if (i < skip.size() && skip[i]) continue;
    rank_sum_[kept++] = rank_sum_[i];
  }
  return MeanOverMax(std::span<const uint64_t>(rank_sum_.data(), kept));
}

double MeanOverMax(std::span<const uint64_t> loads) {
  if (loads.empty()) return 1.0;
  uint64_t most = 0, total = 0;
  for (uint64_t v : loads) {
    most = std::max(most, v);
    total += v;
  }
  if (most == 0) return 1.0;
  return static_cast<double>(total) / static_cast<double>(loads.size()) / static_cast<double>(most);
}

}  // namespace moerun
