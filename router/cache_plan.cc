#include "router/cache_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <utility>

namespace moerun {
namespace {

// One expert's load on one rank.
struct Entry {
  double w = 0;
  int e = 0;
};

// The cache's order: more load first, then the lower expert number.
bool Before(const Entry& a, const Entry& b) { return a.w > b.w || (a.w == b.w && a.e < b.e); }

int BudgetOf(const std::vector<int>& cache_experts, size_t i) {
  return i < cache_experts.size() ? std::max(cache_experts[i], 0) : 0;
}

// The load on the resident copies of one rank: `entries` one per expert; budget 0: no cache.
double ResidentLoad(std::vector<Entry> entries, int budget) {
  const size_t keep =
      budget <= 0 ? entries.size() : std::min(entries.size(), static_cast<size_t>(budget));
  std::sort(entries.begin(), entries.end(), Before);
  double sum = 0;
  for (size_t k = 0; k < keep; ++k) sum += entries[k].w;
  return sum;
}

// Entries with one expert twice (a planner's map may hold two copies on a rank) merged.
std::vector<Entry> Merged(std::vector<Entry> entries) {
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.e < b.e; });
  std::vector<Entry> out;
  for (const Entry& x : entries) {
    if (!out.empty() && out.back().e == x.e) {
      out.back().w += x.w;
    } else {
      out.push_back(x);
    }
  }
  return out;
}

// Resident ÷ total over the given ranks (entries and budget per rank).
double HitRateOf(const std::vector<std::pair<std::vector<Entry>, int>>& ranks) {
  double total = 0, resident = 0;
  bool cache = false;
  for (const auto& [entries, budget] : ranks) {
    for (const Entry& x : entries) total += x.w;
    resident += ResidentLoad(entries, budget);
    cache = cache || budget > 0;
  }
  if (!cache || !(total > 0)) return 1.0;
  return std::min(1.0, resident / total);
}

std::vector<double> RankLoadsOf(const std::vector<double>& w, size_t per_rank, size_t ranks) {
  std::vector<double> load(ranks, 0.0);
  for (size_t s = 0; s < w.size(); ++s) load[s / per_rank] += w[s];
  return load;
}

}  // namespace

bool AnyCache(const std::vector<int>& cache_experts) {
  return std::any_of(cache_experts.begin(), cache_experts.end(), [](int b) { return b > 0; });
}

Status CheckCacheExperts(const std::vector<int>& cache_experts, int expert_ranks,
                         const std::string& what) {
  if (cache_experts.size() > static_cast<size_t>(std::max(expert_ranks, 0))) {
    return Status::InvalidArgument(
        fmt::format("{} gives {} expert cache budgets, but the placement has {} expert ranks (give "
                    "one per expert rank, the first expert rank first)",
                    what, cache_experts.size(), expert_ranks));
  }
  for (size_t i = 0; i < cache_experts.size(); ++i) {
    if (cache_experts[i] < 0) {
      return Status::InvalidArgument(fmt::format(
          "{}: expert rank {} (index {}) has a cache of {} experts; give 0 (no cache) or more",
          what, i, i, cache_experts[i]));
    }
  }
  return Status::Ok();
}

double PredictedHitRate(const std::vector<double>& layer_load, const LayerMaps& maps, int num_ranks,
                        const std::vector<int>& cache_experts) {
  const size_t slots = maps.phy2log.size();
  if (num_ranks < 1 || slots == 0 || slots % static_cast<size_t>(num_ranks) != 0) return 1.0;
  const size_t per_rank = slots / static_cast<size_t>(num_ranks);
  std::vector<int> cnt(layer_load.size(), 0);
  for (int e : maps.phy2log) {
    if (e >= 0 && static_cast<size_t>(e) < cnt.size()) ++cnt[static_cast<size_t>(e)];
  }
  std::vector<std::pair<std::vector<Entry>, int>> ranks(static_cast<size_t>(num_ranks));
  for (size_t s = 0; s < slots; ++s) {
    const int e = maps.phy2log[s];
    if (e < 0 || static_cast<size_t>(e) >= cnt.size()) continue;
    ranks[s / per_rank].first.push_back(
        Entry{layer_load[static_cast<size_t>(e)] / cnt[static_cast<size_t>(e)], e});
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    ranks[r].first = Merged(std::move(ranks[r].first));
    ranks[r].second = BudgetOf(cache_experts, r);
  }
  return HitRateOf(ranks);
}

double PlacementHitRate(const std::vector<double>& layer_load, const LayerPlacement& placement,
                        int num_routers, const std::vector<int>& cache_experts,
                        const std::vector<int>& exclude) {
  std::vector<std::pair<std::vector<Entry>, int>> ranks;
  for (size_t r = static_cast<size_t>(std::max(num_routers, 0)); r < placement.rank_slots.size();
       ++r) {
    if (std::find(exclude.begin(), exclude.end(), static_cast<int>(r)) != exclude.end()) continue;
    std::vector<Entry> entries;
    for (int s : placement.rank_slots[r]) {
      const int e = placement.slots[static_cast<size_t>(s)].expert;
      if (e < 0 || static_cast<size_t>(e) >= layer_load.size()) continue;
      entries.push_back(
          Entry{layer_load[static_cast<size_t>(e)] /
                    static_cast<double>(placement.replicas[static_cast<size_t>(e)].size()),
                e});
    }
    ranks.emplace_back(Merged(std::move(entries)),
                       BudgetOf(cache_experts, r - static_cast<size_t>(num_routers)));
  }
  return HitRateOf(ranks);
}

LayerMaps ImproveForCache(const std::vector<double>& layer_load, const LayerMaps& maps,
                          int num_ranks, const std::vector<int>& cache_experts) {
  const size_t slots = maps.phy2log.size();
  const size_t num_log = layer_load.size();
  if (!AnyCache(cache_experts) || num_ranks < 1 || slots == 0 ||
      slots % static_cast<size_t>(num_ranks) != 0) {
    return maps;
  }
  const size_t ranks = static_cast<size_t>(num_ranks);
  const size_t per_rank = slots / ranks;
  std::vector<int> p2l = maps.phy2log;
  std::vector<int> cnt(num_log, 0);
  for (int e : p2l) {
    if (e < 0 || static_cast<size_t>(e) >= num_log) return maps;
    ++cnt[static_cast<size_t>(e)];
  }
  std::vector<char> holds(ranks * num_log, 0);
  auto held = [&](size_t r, int e) -> char& { return holds[r * num_log + static_cast<size_t>(e)]; };
  for (size_t s = 0; s < slots; ++s) {
    if (held(s / per_rank, p2l[s])++ > 0) return maps;  // two copies on a rank: as they are
  }
  // The resident count of each rank: all its slots without a cache, or with room for them all.
  std::vector<size_t> keep(ranks, per_rank);
  bool any = false;
  for (size_t r = 0; r < ranks; ++r) {
    const int b = BudgetOf(cache_experts, r);
    if (b > 0 && static_cast<size_t>(b) < per_rank) keep[r] = static_cast<size_t>(b), any = true;
  }
  if (!any) return maps;  // every rank holds all it hosts: nothing to gain

  std::vector<double> w(slots);  // each slot's load, as PredictedBalancedness splits it
  double total = 0;
  for (size_t s = 0; s < slots; ++s) {
    w[s] = layer_load[static_cast<size_t>(p2l[s])] / cnt[static_cast<size_t>(p2l[s])];
    total += w[s];
  }
  if (!(total > 0)) return maps;
  std::vector<double> rank_load = RankLoadsOf(w, per_rank, ranks);
  const double cap = *std::max_element(rank_load.begin(), rank_load.end());
  const double min_gain = 1e-12 * total;

  std::vector<std::vector<size_t>> order(ranks);  // per rank: its slots in the cache's order
  std::vector<size_t> pos(slots);                 // each slot's place in its rank's order
  auto sort_rank = [&](size_t r) {
    std::vector<size_t>& o = order[r];
    o.resize(per_rank);
    for (size_t k = 0; k < per_rank; ++k) o[k] = r * per_rank + k;
    std::sort(o.begin(), o.end(), [&](size_t x, size_t y) {
      return Before({w[x], p2l[x]}, {w[y], p2l[y]});
    });
    for (size_t k = 0; k < per_rank; ++k) pos[o[k]] = k;
  };
  for (size_t r = 0; r < ranks; ++r) sort_rank(r);
  // The change of rank r's resident load when slot s (on r) holds y instead.
  auto delta = [&](size_t r, size_t s, const Entry& y) {
    const double x = w[s];
    const size_t b = keep[r];
    if (b >= per_rank) return y.w - x;
    const size_t p = pos[s];
    const size_t smallest = order[r][p < b ? b : b - 1];  // the last resident once s is empty
    const double removed = p < b ? w[smallest] - x : 0.0;
    const Entry m{w[smallest], p2l[smallest]};
    return removed + (Before(y, m) ? y.w - m.w : 0.0);
  };

  std::set<std::pair<size_t, size_t>> refused;  // swaps that the exact sums put over the cap
  for (size_t iter = 0; iter < 20 * slots; ++iter) {
    double best = min_gain;
    size_t bi = slots, bj = slots;
    for (size_t i = 0; i < slots; ++i) {
      const size_t a = i / per_rank;
      const int ei = p2l[i];
      for (size_t j = (a + 1) * per_rank; j < slots; ++j) {
        const size_t b = j / per_rank;
        const int ej = p2l[j];
        if (held(b, ei) > 0 || held(a, ej) > 0) continue;
        if (rank_load[a] - w[i] + w[j] > cap || rank_load[b] - w[j] + w[i] > cap) continue;
        const double gain = delta(a, i, Entry{w[j], ej}) + delta(b, j, Entry{w[i], ei});
        if (gain > best && refused.count({i, j}) == 0) best = gain, bi = i, bj = j;
      }
    }
    if (bi == slots) break;
    const size_t a = bi / per_rank, b = bj / per_rank;
    std::swap(p2l[bi], p2l[bj]);
    std::swap(w[bi], w[bj]);
    std::vector<double> exact = RankLoadsOf(w, per_rank, ranks);
    if (std::max(exact[a], exact[b]) > cap) {  // rounding: undo, and never try it again
      std::swap(p2l[bi], p2l[bj]);
      std::swap(w[bi], w[bj]);
      refused.insert({bi, bj});
      continue;
    }
    held(a, p2l[bj]) = 0;
    held(b, p2l[bi]) = 0;
    held(a, p2l[bi]) = 1;
    held(b, p2l[bj]) = 1;
    rank_load = std::move(exact);
    sort_rank(a);
    sort_rank(b);
  }
  if (p2l == maps.phy2log) return maps;
  LayerMaps out;
  out.log2phy.resize(num_log);
  out.logcnt.assign(num_log, 0);
  for (size_t s = 0; s < slots; ++s) {
    const size_t e = static_cast<size_t>(p2l[s]);
    out.log2phy[e].push_back(static_cast<int>(s));
    ++out.logcnt[e];
  }
  out.phy2log = std::move(p2l);
  return out;
}

}  // namespace moerun
