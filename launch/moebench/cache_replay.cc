#include "launch/moebench/cache_replay.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "base/exit_code.h"
#include "base/log.h"
#include "router/replay/routing_trace.h"

namespace moerun::bench {

namespace {

std::string Num(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", x);
  return b;
}

}  // namespace

Status Validate(const CacheReplayFlags& f) {
  if (f.traces.empty()) return Status::InvalidArgument("--trace: give at least one file");
  if (f.ranks.empty()) return Status::InvalidArgument("--ranks: give at least one rank count");
  for (int r : f.ranks) {
    if (r < 1) return Status::InvalidArgument("--ranks: " + std::to_string(r) + " is not >= 1");
  }
  if (f.budgets.empty()) return Status::InvalidArgument("--budget: give at least one fraction");
  for (double b : f.budgets) {
    if (!(b > 0 && b <= 1)) {
      return Status::InvalidArgument("--budget: " + Num(b) +
                                     " is not a fraction in (0, 1] of the hosted experts");
    }
  }
  if (f.batches.empty()) return Status::InvalidArgument("--batch: give at least one batch size");
  for (int64_t b : f.batches) {
    if (b < 1) return Status::InvalidArgument("--batch: " + std::to_string(b) + " is not >= 1");
  }
  if (f.policies.empty()) return Status::InvalidArgument("--policies: give at least one policy");
  for (const std::string& p : f.policies) {
    if (Result<EvictionPolicy> e = ParseEvictionPolicy(p); !e.ok()) {
      return Status::InvalidArgument("--policies: " + e.status().message());
    }
  }
  if (f.lookahead.empty()) return Status::InvalidArgument("--lookahead: give 0, 1 or 0,1");
  for (int a : f.lookahead) {
    if (a != 0 && a != 1) {
      return Status::InvalidArgument("--lookahead: " + std::to_string(a) + " is not 0 or 1");
    }
  }
  for (double h : f.half_lives) {
    if (!(h > 0) || !std::isfinite(h)) {
      return Status::InvalidArgument("--half-life: " + Num(h) + " is not > 0");
    }
  }
  return Status::Ok();
}

namespace {

// A tiny expert: every one has the same bytes, which is all the cache looks at.
ExpertWeights TinyExpert() {
  ExpertWeights w;
  w.hidden = 8;
  w.inter = 8;
  w.pairs = 1;
  w.w13 = PackedMatrix(DType::kF32, 16, 8, 8);
  w.w2 = PackedMatrix(DType::kF32, 8, 8, 8);
  return w;
}

}  // namespace

Result<ReplayCounts> ReplayExpertCache(const std::vector<CacheStep>& steps,
                                       const HostedExperts& hosted, const ReplayOptions& o) {
  if (o.capacity < 1) return Status::InvalidArgument("cache replay: a cache of no expert");
  if (o.lookahead != 0 && o.lookahead != 1) {
    return Status::InvalidArgument("cache replay: look-ahead must be 0 or 1");
  }
  const size_t one = TinyExpert().bytes();
  std::vector<std::vector<ExpertWeights>> storage(hosted.size());
  std::map<int, std::vector<ExpertWeights>*> layers;
  for (size_t l = 0; l < hosted.size(); ++l) {
    storage[l].resize(hosted[l].size());
    layers[static_cast<int>(l)] = &storage[l];
  }
  ExpertCacheOptions opts;
  opts.budget_bytes = one * static_cast<size_t>(o.capacity);
  opts.loaders = 1;
  opts.policy = o.policy;
  if (o.half_life > 0) opts.half_life = o.half_life;
  ExpertCache cache(
      opts, [](int, int, const std::string&) -> Result<ExpertWeights> { return TinyExpert(); },
      std::move(layers));
  for (size_t l = 0; l < hosted.size(); ++l) {
    for (size_t e = 0; e < hosted[l].size(); ++e) {
      if (hosted[l][e]) cache.Host(static_cast<int>(l), static_cast<int>(e), true);
    }
  }

  ReplayCounts c;
  auto note_resident = [&] {
    c.max_resident = std::max<int64_t>(
        c.max_resident, static_cast<int64_t>(cache.resident_bytes() / std::max<size_t>(one, 1)));
  };
  // Polls and waits until every expert of `s` is resident (loads go one at a time, in order).
  auto wait_resident = [&](const CacheStep& s) -> Status {
    const auto until = SteadyClock::now() + std::chrono::seconds(60);
    for (;;) {
      MOERUN_RETURN_IF_ERROR(cache.Poll());
      note_resident();
      bool all = true;
      for (int e : s.experts) {
        MOERUN_RETURN_IF_ERROR(cache.Failed(s.layer, e));
        if (!cache.resident(s.layer, e)) all = false;
      }
      if (all) return Status::Ok();
      if (SteadyClock::now() > until) {
        return Status::Internal("cache replay: a load of layer " + std::to_string(s.layer) +
                                " did not finish within a minute");
      }
      cache.WaitForLoad(SteadyClock::now() + std::chrono::milliseconds(100));
    }
  };
  // The step's Tick and Need; returns the experts that missed.
  std::vector<int> missed;
  auto need = [&](const CacheStep& s) {
    missed.clear();
    for (int e : s.experts) {
      if (!cache.resident(s.layer, e)) missed.push_back(e);
    }
    cache.Tick();
    for (int e : s.experts) cache.Need(s.layer, e);
  };
  auto done = [&](const CacheStep& s) -> Status {
    for (int e : s.experts) cache.Done(s.layer, e);
    return cache.Poll();
  };

  if (o.lookahead == 0) {
    for (const CacheStep& s : steps) {
      need(s);
      MOERUN_RETURN_IF_ERROR(wait_resident(s));
      MOERUN_RETURN_IF_ERROR(done(s));
    }
  } else if (!steps.empty()) {
    need(steps[0]);
    MOERUN_RETURN_IF_ERROR(wait_resident(steps[0]));
    for (size_t i = 0; i < steps.size(); ++i) {
      if (i + 1 < steps.size()) {
        // The next header arrives while step i computes: its misses load now.
        const CacheStep& n = steps[i + 1];
        need(n);
        MOERUN_RETURN_IF_ERROR(wait_resident(n));
        for (int e : missed) c.prefetched += cache.resident(n.layer, e);
      }
      MOERUN_RETURN_IF_ERROR(done(steps[i]));
    }
  }
  note_resident();
  const ExpertCacheStats& st = cache.stats();
  c.hits = static_cast<int64_t>(st.hits.load());
  c.misses = static_cast<int64_t>(st.misses.load());
  c.needs = c.hits + c.misses;
  c.evictions = static_cast<int64_t>(st.evictions.load());
  return c;
}

namespace {

// lfu and cycle age their counts over a half-life; lru and adaptive have none.
bool HasHalfLife(EvictionPolicy p) {
  return p == EvictionPolicy::kLfu || p == EvictionPolicy::kCycle;
}

struct Config {
  std::string policy;
  EvictionPolicy p;
  double half_life;  // 0: the default
  int lookahead;
};

std::string Pct(double x) {
  char b[16];
  std::snprintf(b, sizeof b, "%5.1f", 100 * x);
  return b;
}

Status Run(const CacheReplayFlags& f, nlohmann::json* out) {
  const double default_half_life = ExpertCacheOptions{}.half_life;
  std::vector<Config> configs;
  for (const std::string& name : f.policies) {
    MOERUN_ASSIGN_OR_RETURN(const EvictionPolicy p, ParseEvictionPolicy(name));
    std::vector<double> hls = {0};
    if (HasHalfLife(p) && !f.half_lives.empty()) hls = f.half_lives;
    for (double h : hls) {
      for (int a : f.lookahead) configs.push_back(Config{name, p, h, a});
    }
  }
  nlohmann::json traces = nlohmann::json::array(), results = nlohmann::json::array();
  bool header = false;  // printed before the first row (an error before it stays one line)
  for (const std::string& path : f.traces) {
    MOERUN_ASSIGN_OR_RETURN(const RoutingTrace trace, ReadRoutingTrace(path));
    if (!trace.token_level()) {
      return Status::InvalidArgument(path +
                                     ": window counts, not token-level routing: the cache replay "
                                     "needs each token's experts (.npy batches, .jsonl traces)");
    }
    int64_t tokens = 0;
    for (const auto& s : trace.streams) tokens += s.tokens;
    traces.push_back({{"trace", path},
                      {"layers", trace.num_layers()},
                      {"experts", trace.num_experts},
                      {"top_k", trace.top_k},
                      {"streams", trace.streams.size()},
                      {"tokens", tokens}});
    const std::string shown = path.substr(path.find_last_of('/') + 1);
    for (int R : f.ranks) {
      if (R > trace.num_experts) {
        return Status::InvalidArgument("--ranks " + std::to_string(R) + ": more ranks than the " +
                                       std::to_string(trace.num_experts) + " experts of " + path);
      }
      std::vector<HostedExperts> hosted;
      std::vector<int64_t> hosted_count;
      for (int r = 0; r < R; ++r) {
        MOERUN_ASSIGN_OR_RETURN(HostedExperts h,
                                LinearHosted(trace.num_layers(), trace.num_experts, R, r));
        int64_t n = 0;
        for (const auto& l : h) n += std::count(l.begin(), l.end(), char{1});
        hosted.push_back(std::move(h));
        hosted_count.push_back(n);
      }
      for (int64_t B : f.batches) {
        std::vector<std::vector<CacheStep>> steps;
        for (int r = 0; r < R; ++r) {
          MOERUN_ASSIGN_OR_RETURN(auto s, RankCacheSteps(trace, hosted[static_cast<size_t>(r)], B));
          steps.push_back(std::move(s));
        }
        for (double budget : f.budgets) {
          nlohmann::json res = {{"trace", path}, {"ranks", R}, {"batch", B}, {"budget", budget}};
          std::vector<int64_t> cap(static_cast<size_t>(R));
          std::vector<CacheCounts> bel(static_cast<size_t>(R)), fixed(static_cast<size_t>(R));
          std::vector<int> active;  // ranks with any need (the averages are over these)
          int64_t n_steps = 0, distinct = 0;
          for (int r = 0; r < R; ++r) {
            const size_t ri = static_cast<size_t>(r);
            cap[ri] = std::max<int64_t>(
                1, static_cast<int64_t>(std::floor(budget * hosted_count[ri] + 1e-9)));
            MOERUN_ASSIGN_OR_RETURN(bel[ri], BeladyCounts(steps[ri], cap[ri]));
            MOERUN_ASSIGN_OR_RETURN(fixed[ri], StaticBestCounts(steps[ri], cap[ri]));
            n_steps += static_cast<int64_t>(steps[ri].size());
            distinct += DistinctExperts(steps[ri]);
            if (bel[ri].needs > 0) active.push_back(r);
          }
          CacheCounts bsum;
          double bmean = 0, bworst = 1, smean = 0;
          for (int r : active) {
            const CacheCounts& b = bel[static_cast<size_t>(r)];
            bsum.needs += b.needs;
            bsum.hits += b.hits;
            bsum.misses += b.misses;
            bsum.compulsory += b.compulsory;
            bmean += b.hit_rate() / static_cast<double>(active.size());
            smean += fixed[static_cast<size_t>(r)].hit_rate() / static_cast<double>(active.size());
            bworst = std::min(bworst, b.hit_rate());
          }
          if (active.empty()) bworst = 0;
          res["capacity"] = cap;
          res["hosted"] = hosted_count;
          res["steps"] = n_steps;
          res["distinct_experts"] = distinct;
          res["needs"] = bsum.needs;
          res["belady"] = {{"hit_rate", bmean},
                           {"hit_rate_worst", bworst},
                           {"hits", bsum.hits},
                           {"misses", bsum.misses},
                           {"compulsory", bsum.compulsory}};
          res["static_best"] = {{"hit_rate", smean}};
          nlohmann::json pols = nlohmann::json::array();
          for (const Config& cfg : configs) {
            ReplayCounts sum;
            double mean = 0, worst = 1, gap = 0, gap_worst = -1;
            for (int r : active) {
              const size_t ri = static_cast<size_t>(r);
              ReplayOptions ro;
              ro.capacity = cap[ri];
              ro.policy = cfg.p;
              ro.half_life = cfg.half_life;
              ro.lookahead = cfg.lookahead;
              MOERUN_ASSIGN_OR_RETURN(const ReplayCounts rc,
                                      ReplayExpertCache(steps[ri], hosted[ri], ro));
              if (rc.needs != bel[ri].needs) {
                return Status::Internal("cache replay: the cache counted " +
                                        std::to_string(rc.needs) + " needs, the steps hold " +
                                        std::to_string(bel[ri].needs));
              }
              sum.needs += rc.needs;
              sum.hits += rc.hits;
              sum.misses += rc.misses;
              sum.prefetched += rc.prefetched;
              sum.evictions += rc.evictions;
              sum.max_resident = std::max(sum.max_resident, rc.max_resident - cap[ri]);
              const double n = static_cast<double>(active.size());
              mean += rc.hit_rate() / n;
              worst = std::min(worst, rc.hit_rate());
              const double g = 100 * (bel[ri].hit_rate() - rc.hit_rate());
              gap += g / n;
              gap_worst = std::max(gap_worst, g);
            }
            if (active.empty()) worst = gap_worst = 0;
            const double hl =
                HasHalfLife(cfg.p) ? (cfg.half_life > 0 ? cfg.half_life : default_half_life) : 0;
            nlohmann::json pj = {
                {"policy", cfg.policy},       {"lookahead", cfg.lookahead},
                {"hit_rate", mean},           {"hit_rate_worst", worst},
                {"gap_points", gap},          {"gap_points_worst", gap_worst},
                {"needs", sum.needs},         {"hits", sum.hits},
                {"misses", sum.misses},       {"prefetched", sum.prefetched},
                {"evictions", sum.evictions}, {"max_over_capacity", sum.max_resident}};
            if (HasHalfLife(cfg.p)) pj["half_life"] = hl;
            pols.push_back(std::move(pj));
            std::string label = cfg.policy;
            if (HasHalfLife(cfg.p)) {
              label += "/" + std::to_string(static_cast<int>(hl));
            }
            if (!header) {
              header = true;
              std::fprintf(stderr, "%-28s %3s %5s %6s %-10s %2s %7s %7s %7s %7s %9s %7s\n", "trace",
                           "R", "B", "budget", "policy", "la", "hit%", "worst%", "belady%",
                           "gap_pt", "compuls%", "static%");
            }
            std::fprintf(
                stderr, "%-28s %3d %5lld %6.2f %-10s %2d %7s %7s %7s %7.1f %9s %7s\n",
                shown.substr(0, 28).c_str(), R, static_cast<long long>(B), budget, label.c_str(),
                cfg.lookahead, Pct(mean).c_str(), Pct(worst).c_str(), Pct(bmean).c_str(), gap,
                Pct(bsum.needs > 0
                        ? static_cast<double>(bsum.compulsory) / static_cast<double>(bsum.misses)
                        : 0)
                    .c_str(),
                Pct(smean).c_str());
          }
          res["policies"] = std::move(pols);
          results.push_back(std::move(res));
        }
      }
    }
  }
  *out = {{"bench", "cache-replay"}, {"traces", traces}, {"results", results}};
  return Status::Ok();
}

}  // namespace

int RunCacheReplay(const CacheReplayFlags& f) {
  if (Status s = Validate(f); !s.ok()) return FailWith(s);
  nlohmann::json out;
  if (Status s = Run(f, &out); !s.ok()) return FailWith(s);
  if (f.json) std::cout << out.dump(2) << std::endl;
  return 0;
}

}  // namespace moerun::bench
