// What one expert rank's cache sees when token-level routing is replayed, and the fewest misses
// any eviction policy could have on it (Belady's offline optimum). Pure functions, no threads.
//
// Steps: the trace's tokens go in batches of B consecutive tokens of one stream (a prefill batch
// is one stream; a decode trace has one stream per request, and a batch never mixes streams);
// each batch goes through the layers in order, and at each layer the rank sees one step: the set
// of its hosted experts that the batch's tokens chose there. Time order is batch by batch, layer
// by layer within a batch. A layer where the batch needs none of the rank's experts is no step
// (no dispatch header reaches the rank).
//
// The cache model (that of runtime/cache/expert_cache.h with equal expert sizes): a cache of C
// experts, empty at the start; a step's experts must be resident together, so a step counts one
// hit or one miss per expert it needs (as ExpertCache counts Need), loads its misses, and may
// evict only experts the step does not need. A step that needs more than C experts holds them all
// while it runs (the cache goes over its budget as ExpertCache does) and is trimmed back to C
// after it.
#pragma once

#include <cstdint>
#include <vector>

#include "base/status.h"
#include "router/planner.h"
#include "router/replay/routing_trace.h"

namespace moerun {

// hosted[l][e]: the rank hosts expert e of layer index l.
using HostedExperts = std::vector<std::vector<char>>;

// Experts of each layer split over `num_ranks` in expert order: rank r hosts
// [r * E / R, (r + 1) * E / R). InvalidArgument unless 0 <= rank < num_ranks <= num_experts.
Result<HostedExperts> LinearHosted(int num_layers, int num_experts, int num_ranks, int rank);

// The logical experts whose slots a plan places on `rank` (slot s on rank s / (slots / R)), per
// layer. InvalidArgument if a layer's slots are not a multiple of num_ranks, rank is out of range,
// or a slot names an expert outside [0, num_experts).
Result<HostedExperts> HostedFromMaps(const std::vector<LayerMaps>& maps, int num_experts,
                                     int num_ranks, int rank);

struct CacheStep {
  int layer = 0;             // layer index in the trace
  std::vector<int> experts;  // the rank's experts this batch needs there, ascending, distinct
};

// The rank's steps over the whole trace. InvalidArgument if the trace is not token-level,
// batch_tokens < 1, or `hosted` does not have the trace's layers x experts shape.
Result<std::vector<CacheStep>> RankCacheSteps(const RoutingTrace& trace,
                                              const HostedExperts& hosted, int64_t batch_tokens);

struct CacheCounts {
  int64_t needs = 0;  // experts needed over all steps (hits + misses)
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t compulsory = 0;  // misses on an expert's first use: every policy pays them
  double hit_rate() const { return needs > 0 ? static_cast<double>(hits) / needs : 0.0; }
};

// Distinct (layer, expert) pairs over the steps.
int64_t DistinctExperts(const std::vector<CacheStep>& steps);

// Belady's optimum for a cache of `capacity` experts: on a miss, evict the resident expert (not
// needed by the current step) whose next use is furthest in the future (never used again first);
// after a step larger than the cache, keep the `capacity` of its experts used soonest. For equal
// sizes and a step's set resident together this is the fewest misses any policy can have (tested
// against an exhaustive search of every eviction choice). InvalidArgument if capacity < 1.
Result<CacheCounts> BeladyCounts(const std::vector<CacheStep>& steps, int64_t capacity);

// The best fixed set, a reference for frequency policies: the `capacity` experts needed most often
// over the whole trace stay resident once loaded (each pays its first use) and nothing else is
// ever kept. It knows the trace's counts, not their order. Not a policy the cache model allows in
// general: it ignores that a step's other experts need room beside the set (where steps are small
// next to the cache, as in the replays, that room is small). InvalidArgument if capacity < 1.
Result<CacheCounts> StaticBestCounts(const std::vector<CacheStep>& steps, int64_t capacity);

}  // namespace moerun
