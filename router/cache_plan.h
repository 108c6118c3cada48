// Placement and the expert cache: an expert rank with an expert cache (cache/) hosts more experts
// than its memory holds, and only the hot ones stay resident. This predicts the cache's hit rate
// for a placement, and refines a plan so that hot experts stay resident.
//
// The prediction, per layer: each expert's load is split evenly over its replicas; on a rank whose
// cache holds B experts (B > 0), the B experts it hosts with the most load there (ties: the lower
// expert number) are resident, the others miss; a rank without a cache (B = 0), or with B at least
// the experts it hosts, has everything resident. The hit rate is the load on resident copies ÷ the
// total load, over the live expert ranks; 1 where all loads are 0 or no rank has a cache.
// Pure and deterministic.
#pragma once

#include <string>
#include <vector>

#include "base/status.h"
#include "router/placement.h"
#include "router/planner.h"

namespace moerun {

// Whether any of `cache_experts` is a cache (> 0).
bool AnyCache(const std::vector<int>& cache_experts);

// InvalidArgument for a budget list longer than the `expert_ranks` of the job, or a negative
// budget; the message names `what` (a flag or field) and says what would do.
Status CheckCacheExperts(const std::vector<int>& cache_experts, int expert_ranks,
                         const std::string& what);

// The predicted hit rate of planner maps: slot s on planned rank s / (slots / num_ranks);
// cache_experts[i]: the cache of planned rank i (missing or 0: none).
double PredictedHitRate(const std::vector<double>& layer_load, const LayerMaps& maps, int num_ranks,
                        const std::vector<int>& cache_experts);

// The predicted hit rate of a layer of a placement table: cache_experts[i] is the cache of expert
// rank num_routers + i (missing or 0: none); the ranks in `exclude` (dead) are left out, each
// expert's load still split over all its replicas (as PlacementBalancedness does).
double PlacementHitRate(const std::vector<double>& layer_load, const LayerPlacement& placement,
                        int num_routers, const std::vector<int>& cache_experts,
                        const std::vector<int>& exclude = {});

// `maps` refined for the caches (cache_experts per planned rank, as PredictedHitRate): repeatedly
// the swap of the contents of two slots on different ranks that most raises the predicted hit rate
// (ties: the lowest pair of slots), among the swaps that keep every rank's load (each expert's load
// split over its slots, as PredictedBalancedness computes it) at most the max rank load of `maps`,
// and that place no expert on a rank that holds it already. Stops when no swap raises the hit rate
// or after 20 × slots swaps. Swaps keep every expert's replica count, so the mean rank load stays
// and the predicted balancedness never drops. Maps that hold an expert twice on one rank (which a
// placement table cannot hold), and maps without a cache, come back as they are; changed maps
// have log2phy in slot order. O(slots²) per swap.
LayerMaps ImproveForCache(const std::vector<double>& layer_load, const LayerMaps& maps,
                          int num_ranks, const std::vector<int>& cache_experts);

}  // namespace moerun
