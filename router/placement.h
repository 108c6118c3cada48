// Where experts live: a versioned table of physical expert slots per MoE layer.
//
// Ranks [0, routers) are routers; ranks [routers, ranks) host experts. Each physical slot is
// (rank, logical expert), as EPLB's phy2log; an expert may have several slots (replicas) on
// different ranks. Every expert has at least one slot. Made `linear` (contiguous blocks of
// experts per rank), `round_robin`, or read from JSON:
//
//   {"format": "moerun-placement-v1", "version": 7, "num_experts": 16, "num_ranks": 4,
//    "num_routers": 1,
//    "layers": {"3": [[1, 0], [1, 1], [2, 2], [3, 0], ...],   // [rank, expert] per slot
//               "*": [...]}}                                    // any layer not listed
//
// Immutable after construction (a new version is a new object); thread-safe to read.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "base/status.h"

namespace moerun {

struct Slot {
  int rank = 0;
  int expert = 0;
};

struct LayerPlacement {
  std::vector<Slot> slots;                   // physical slot -> (rank, logical expert)
  std::vector<std::vector<int>> replicas;    // logical expert -> its slots, in slot order
  std::vector<std::vector<int>> rank_slots;  // rank -> its slots, in slot order
  int MaxSlotsPerRank() const;
};

// `lp` without the slots on the ranks `dead` marks (indexed by rank): the same slot numbers, the
// dead ranks' slots left out of `replicas` and `rank_slots`. An expert whose every copy was on a
// dead rank has no replica left (an orphan): *orphans, if given, counts them.
LayerPlacement LiveLayer(const LayerPlacement& lp, const std::vector<bool>& dead,
                         int* orphans = nullptr);

class Placement {
 public:
  static constexpr int kMaxSlotsPerRank = 4096;
  static constexpr int kAnyLayer = -1;

  static Result<Placement> Linear(int num_experts, int ranks, int routers);
  static Result<Placement> RoundRobin(int num_experts, int ranks, int routers);
  static Result<Placement> FromJson(const std::string& text, const std::string& source);
  static Result<Placement> FromFile(const std::string& path);
  // "linear", "round_robin" or a JSON file path.
  static Result<Placement> Make(const std::string& spec, int num_experts, int ranks, int routers);

  // The placement of `layer` (its own entry, else the "*" entry); null if neither exists.
  const LayerPlacement* Layer(int layer) const;
  std::string ToJson() const;
  // A copy whose entry for `layer` is `from`'s placement of that layer, with `version`.
  Result<Placement> WithLayer(int layer, const Placement& from, uint64_t version) const;
  // A copy, with `version`, in which the ranks `dead` marks (indexed by rank) hold nothing: their
  // slots are dropped, and an expert left with no copy gets one on the surviving expert rank with
  // the fewest slots in that layer (the lowest rank among equals), so that the survivors share the
  // orphans evenly; with `capacity` (by rank: the most slots per layer its memory holds, < 0: no
  // limit), among the survivors with room (only where none has room, among all: an expert must
  // keep a copy). *replaced, if given, counts those new copies over all layer entries. Fails when
  // no expert rank survives.
  Result<Placement> WithoutRanks(const std::vector<bool>& dead, uint64_t version,
                                 int* replaced = nullptr,
                                 const std::vector<int>& capacity = {}) const;
  // Whether a slot of any layer entry (or, given `layers`, of the entries those layers use) is on
  // a rank `dead` marks.
  bool UsesAny(const std::vector<bool>& dead) const;
  bool UsesAny(const std::vector<bool>& dead, const std::vector<int>& layers) const;
  // Whether two layer placements have the same slots in the same order.
  static bool SameSlots(const LayerPlacement& a, const LayerPlacement& b);

  uint64_t version() const { return version_; }
  int num_experts() const { return num_experts_; }
  int num_ranks() const { return num_ranks_; }
  int num_routers() const { return num_routers_; }
  // Experts hosted by `rank` in `layer` (a mask over logical experts).
  std::vector<bool> ExpertsOf(int rank, int layer) const;
  // Checks the table against a job: its rank/router counts and the model's expert count.
  Status CheckFits(int ranks, int routers, int num_experts) const;

 private:
  Status AddLayer(int layer, std::vector<Slot> slots, const std::string& source);

  uint64_t version_ = 1;
  int num_experts_ = 0, num_ranks_ = 0, num_routers_ = 0;
  std::map<int, LayerPlacement> layers_;
};

}  // namespace moerun
