// `moebench cache-replay`: the expert cache's own code (runtime/cache/expert_cache.h) replayed
// over token-level routing recorded from real inference, against Belady's offline optimum.
//
// For each trace, rank count R (experts of each layer split over the ranks in expert order),
// batch size B, budget (a fraction of the rank's hosted experts over all layers: C experts) and
// policy (adaptive, cycle, lfu, lru), every rank's steps (router/replay/cache_sim.h: batch by
// batch, layer by layer, the rank's experts each batch needs there) drive a real ExpertCache of C
// experts' bytes (tiny experts of equal size, loaded by its own loader thread from a fetch
// function) with:
//   look-ahead 0: step i's Tick and Need, its loads, its Done, then step i+1;
//   look-ahead 1: step i+1's Tick and Need come before step i's Done, as when the dispatch header
//                 of the next microbatch arrives while this one computes: its experts are held
//                 and its loads start one step early (the loads of step i+1 go in while step i is
//                 still held; the cache may go over its budget for two steps' experts).
// The replay is deterministic: it waits until every load a step needs is resident before it goes
// on (one loader, loads in queue order), so hit counts do not depend on thread timing.
// Reported per configuration, averaged over the ranks and for the worst rank: the cache's hit
// rate (hits / needs from its stats), Belady's for a cache of C, the gap in points, Belady's
// compulsory misses (first uses, which every policy pays), and at look-ahead 1 the misses whose
// load started before the previous step was done ("prefetched": what the header buys in latency),
// and the best fixed set's hit rate (cache_sim.h: what knowing only the experts' counts gives).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "router/replay/cache_sim.h"
#include "runtime/cache/expert_cache.h"

namespace moerun::bench {

struct CacheReplayFlags {
  std::vector<std::string> traces;                       // --trace FILE (repeatable)
  std::vector<int> ranks = {1};                          // --ranks R[,R...]
  std::vector<double> budgets = {0.1, 0.25, 0.5, 0.75};  // --budget: fractions of hosted experts
  std::vector<int64_t> batches = {64};                   // --batch B[,B...]: tokens a batch
  std::vector<std::string> policies = {"adaptive", "cycle", "lfu", "lru"};  // --policies
  std::vector<int> lookahead = {0, 1};                                      // --lookahead
  std::vector<double> half_lives;  // --half-life H[,H...] for lfu, cycle (empty: the default)
  bool json = false;
};

// The flags' own checks (ranges, names), no I/O.
Status Validate(const CacheReplayFlags& f);

struct ReplayCounts {
  int64_t needs = 0, hits = 0, misses = 0;
  int64_t prefetched = 0;  // look-ahead 1: misses loaded before the previous step's Done
  int64_t evictions = 0;
  int64_t max_resident = 0;  // most experts resident at once (over C only while steps hold more)
  double hit_rate() const { return needs > 0 ? static_cast<double>(hits) / needs : 0.0; }
};

struct ReplayOptions {
  int64_t capacity = 1;  // experts the budget holds
  EvictionPolicy policy = EvictionPolicy::kLfu;
  double half_life = 0;  // lfu, cycle; 0: ExpertCacheOptions' default
  int lookahead = 0;     // 0 or 1
};

// Drives a real ExpertCache hosting `hosted` through `steps` (layer indices of a trace with
// `hosted`'s shape). An error if a load fails or never finishes (a minute).
Result<ReplayCounts> ReplayExpertCache(const std::vector<CacheStep>& steps,
                                       const HostedExperts& hosted, const ReplayOptions& o);

// The whole subcommand: JSON on stdout with --json, a table on stderr. Exit 0, or 2 on bad input
// (one line naming the file or flag), 1 on another error.
int RunCacheReplay(const CacheReplayFlags& f);

}  // namespace moerun::bench
