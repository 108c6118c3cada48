#include "router/replay/cache_sim.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <utility>

namespace moerun {

Result<HostedExperts> LinearHosted(int num_layers, int num_experts, int num_ranks, int rank) {
  if (num_layers < 1 || num_experts < 1) {
    return Status::InvalidArgument("linear placement: need at least one layer and one expert");
  }
  if (num_ranks < 1 || num_ranks > num_experts) {
    return Status::InvalidArgument("linear placement: " + std::to_string(num_ranks) +
                                   " ranks for " + std::to_string(num_experts) +
                                   " experts (need 1 to the number of experts)");
  }
  if (rank < 0 || rank >= num_ranks) {
    return Status::InvalidArgument("linear placement: rank " + std::to_string(rank) +
                                   " out of range [0, " + std::to_string(num_ranks) + ")");
  }
  const int64_t lo = static_cast<int64_t>(rank) * num_experts / num_ranks;
  const int64_t hi = static_cast<int64_t>(rank + 1) * num_experts / num_ranks;
  HostedExperts h(static_cast<size_t>(num_layers), std::vector<char>(num_experts, 0));
  for (auto& layer : h) {
    for (int64_t e = lo; e < hi; ++e) layer[static_cast<size_t>(e)] = 1;
  }
  return h;
}

Result<HostedExperts> HostedFromMaps(const std::vector<LayerMaps>& maps, int num_experts,
                                     int num_ranks, int rank) {
  if (num_ranks < 1 || rank < 0 || rank >= num_ranks) {
    return Status::InvalidArgument("placement: rank " + std::to_string(rank) + " of " +
                                   std::to_string(num_ranks) + " ranks");
  }
  HostedExperts h(maps.size(), std::vector<char>(static_cast<size_t>(std::max(num_experts, 0)), 0));
  for (size_t l = 0; l < maps.size(); ++l) {
    const auto& slots = maps[l].phy2log;
    if (slots.empty() || slots.size() % static_cast<size_t>(num_ranks) != 0) {
      return Status::InvalidArgument(
          "placement: layer " + std::to_string(l) + " has " + std::to_string(slots.size()) +
          " slots, not a positive multiple of " + std::to_string(num_ranks) + " ranks");
    }
    const size_t per = slots.size() / static_cast<size_t>(num_ranks);
    for (size_t s = per * static_cast<size_t>(rank); s < per * static_cast<size_t>(rank + 1); ++s) {
      const int e = slots[s];
      if (e < 0 || e >= num_experts) {
        return Status::InvalidArgument("placement: layer " + std::to_string(l) + " slot " +
                                       std::to_string(s) + " holds expert " + std::to_string(e) +
                                       ", outside [0, " + std::to_string(num_experts) + ")");
      }
      h[l][static_cast<size_t>(e)] = 1;
    }
  }
  return h;
}

Result<std::vector<CacheStep>> RankCacheSteps(const RoutingTrace& trace,
                                              const HostedExperts& hosted, int64_t batch_tokens) {
  if (!trace.token_level() || trace.top_k < 1) {
    return Status::InvalidArgument(trace.source +
                                   ": the cache replay needs token-level routing (a .npy batch or "
                                   ".jsonl traces), not window counts");
  }
  if (batch_tokens < 1) {
    return Status::InvalidArgument("batch size " + std::to_string(batch_tokens) +
                                   ": need at least one token a batch");
  }
  const int L = trace.num_layers();
  const int E = trace.num_experts;
  if (static_cast<int>(hosted.size()) != L) {
    return Status::InvalidArgument("the placement has " + std::to_string(hosted.size()) +
                                   " layers, the trace " + std::to_string(L));
  }
  for (const auto& row : hosted) {
    if (static_cast<int>(row.size()) != E) {
      return Status::InvalidArgument("the placement has " + std::to_string(row.size()) +
                                     " experts a layer, the trace " + std::to_string(E));
    }
  }
  const int64_t k = trace.top_k;
  std::vector<CacheStep> steps;
  std::vector<char> seen(static_cast<size_t>(E));
  for (const RoutingTrace::Stream& s : trace.streams) {
    if (static_cast<int>(s.ids.size()) != L) {
      return Status::InvalidArgument(trace.source + ": stream '" + s.name + "' has " +
                                     std::to_string(s.ids.size()) + " layers, the trace " +
                                     std::to_string(L));
    }
    for (int64_t t0 = 0; t0 < s.tokens; t0 += batch_tokens) {
      const int64_t t1 = std::min(s.tokens, t0 + batch_tokens);
      for (int l = 0; l < L; ++l) {
        const auto& ids = s.ids[static_cast<size_t>(l)];
        if (static_cast<int64_t>(ids.size()) < t1 * k) {
          return Status::InvalidArgument(trace.source + ": stream '" + s.name + "' layer " +
                                         std::to_string(l) + " has fewer ids than its tokens");
        }
        std::fill(seen.begin(), seen.end(), 0);
        CacheStep step;
        step.layer = l;
        for (int64_t i = t0 * k; i < t1 * k; ++i) {
          const int32_t e = ids[static_cast<size_t>(i)];
          if (e < 0) continue;  // the recording lacks this (token, layer)
          if (e >= E) {
            return Status::InvalidArgument(trace.source + ": expert " + std::to_string(e) +
                                           " out of range in layer " + std::to_string(l));
          }
          const size_t x = static_cast<size_t>(e);
          if (hosted[static_cast<size_t>(l)][x] && !seen[x]) {
            seen[x] = 1;
            step.experts.push_back(e);
          }
        }
        if (step.experts.empty()) continue;
        std::sort(step.experts.begin(), step.experts.end());
        steps.push_back(std::move(step));
      }
    }
  }
  return steps;
}

namespace {

// Dense keys of (layer, expert): layer * stride + expert.
int64_t KeyStride(const std::vector<CacheStep>& steps) {
  int64_t stride = 1;
  for (const CacheStep& s : steps) {
    for (int e : s.experts) stride = std::max<int64_t>(stride, e + 1);
  }
  return stride;
}

int64_t MaxLayer(const std::vector<CacheStep>& steps) {
  int64_t m = 0;
  for (const CacheStep& s : steps) m = std::max<int64_t>(m, s.layer);
  return m;
}

}  // namespace

int64_t DistinctExperts(const std::vector<CacheStep>& steps) {
  const int64_t stride = KeyStride(steps);
  std::vector<char> seen(static_cast<size_t>((MaxLayer(steps) + 1) * stride), 0);
  int64_t n = 0;
  for (const CacheStep& s : steps) {
    for (int e : s.experts) {
      char& x = seen[static_cast<size_t>(s.layer * stride + e)];
      n += !x;
      x = 1;
    }
  }
  return n;
}

Result<CacheCounts> BeladyCounts(const std::vector<CacheStep>& steps, int64_t capacity) {
  if (capacity < 1) {
    return Status::InvalidArgument("cache of " + std::to_string(capacity) +
                                   " experts: need room for at least one");
  }
  const int64_t stride = KeyStride(steps);
  const size_t keys = static_cast<size_t>((MaxLayer(steps) + 1) * stride);
  constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

  // next[i][j]: the step after i where steps[i].experts[j] is needed again (kNever if none).
  std::vector<std::vector<int64_t>> next(steps.size());
  {
    std::vector<int64_t> later(keys, kNever);
    for (size_t i = steps.size(); i-- > 0;) {
      const CacheStep& s = steps[i];
      next[i].resize(s.experts.size());
      for (size_t j = 0; j < s.experts.size(); ++j) {
        const size_t key = static_cast<size_t>(s.layer * stride + s.experts[j]);
        next[i][j] = later[key];
        later[key] = static_cast<int64_t>(i);
      }
    }
  }

  CacheCounts c;
  // Resident experts ordered by next use; `at[key]` is a resident key's next use (-1: absent).
  std::set<std::pair<int64_t, size_t>> by_next;
  std::vector<int64_t> at(keys, -1);
  std::vector<char> used(keys, 0);
  std::vector<size_t> step_keys;
  for (size_t i = 0; i < steps.size(); ++i) {
    const CacheStep& s = steps[i];
    step_keys.clear();
    int64_t misses = 0;
    for (int e : s.experts) {
      const size_t key = static_cast<size_t>(s.layer * stride + e);
      step_keys.push_back(key);
      if (at[key] >= 0) {
        ++c.hits;
        by_next.erase({at[key], key});  // needed now: not a candidate for eviction
      } else {
        ++misses;
        c.compulsory += !used[key];
      }
      used[key] = 1;
      at[key] = -1;
    }
    c.misses += misses;
    c.needs += static_cast<int64_t>(s.experts.size());
    // Room for the step: evict the others, furthest next use first.
    const int64_t room = std::max<int64_t>(capacity, static_cast<int64_t>(s.experts.size()));
    while (!by_next.empty() && static_cast<int64_t>(by_next.size() + s.experts.size()) > room) {
      const auto last = std::prev(by_next.end());
      at[last->second] = -1;
      by_next.erase(last);
    }
    for (size_t j = 0; j < step_keys.size(); ++j) {
      at[step_keys[j]] = next[i][j];
      by_next.insert({next[i][j], step_keys[j]});
    }
    // A step larger than the cache: back to `capacity` after it, keeping the soonest used.
    while (static_cast<int64_t>(by_next.size()) > capacity) {
      const auto last = std::prev(by_next.end());
      at[last->second] = -1;
      by_next.erase(last);
    }
  }
  return c;
}

Result<CacheCounts> StaticBestCounts(const std::vector<CacheStep>& steps, int64_t capacity) {
  if (capacity < 1) {
    return Status::InvalidArgument("cache of " + std::to_string(capacity) +
                                   " experts: need room for at least one");
  }
  const int64_t stride = KeyStride(steps);
  std::vector<int64_t> count(static_cast<size_t>((MaxLayer(steps) + 1) * stride), 0);
  CacheCounts c;
  for (const CacheStep& s : steps) {
    for (int e : s.experts) ++count[static_cast<size_t>(s.layer * stride + e)];
    c.needs += static_cast<int64_t>(s.experts.size());
  }
  std::sort(count.begin(), count.end(), std::greater<>());
  for (size_t i = 0; i < count.size() && static_cast<int64_t>(i) < capacity && count[i] > 0; ++i) {
    c.hits += count[i] - 1;
  }
  c.compulsory = DistinctExperts(steps);
  c.misses = c.needs - c.hits;
  return c;
}

}  // namespace moerun
