// The expert-parallel wire protocol between a router rank and an expert rank.
//
// Per microbatch, for each expert rank that gets rows: the router sends a header (fixed size for
// the job: HeaderBytes) with the row count of each of the rank's slots (in the rank's slot order),
// then the rows themselves (rows x hidden F32, slot after slot); the expert rank answers with the
// same number of rows, in the same order, each the expert's output for that row. Messages between
// one router and one expert rank keep their order, so several microbatches can be in flight.
// A header of kind kShutdown ends the expert rank's service for that router. A header of kind
// kPing asks for an EpPong on kTagPong; since an expert rank handles one router's messages in
// order, the pong also says that every earlier microbatch of that router has been answered.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "router/placement.h"

namespace moerun {

inline constexpr int kTagHeader = 11;
inline constexpr int kTagRows = 12;
inline constexpr int kTagResult = 13;
inline constexpr int kTagPong = 14;
inline constexpr uint32_t kEpMagic = 0x45454f4d;  // "MOEE"

enum class EpKind : uint32_t { kDispatch = 1, kShutdown = 2, kPing = 3 };

struct EpHeaderFixed {
  uint32_t magic = kEpMagic;
  uint32_t kind = 0;
  int32_t layer = 0;
  uint32_t seq = 0;
  int64_t rows = 0;
  int32_t hidden = 0;
  int32_t slots = 0;  // count entries that follow
};
static_assert(sizeof(EpHeaderFixed) == 32);

// An expert rank's answer to kPing: the ping's seq and what the rank reports of itself.
struct EpPong {
  uint32_t magic = kEpMagic;
  uint32_t seq = 0;
  uint64_t microbatches = 0;  // microbatches it has computed, for every router
  uint64_t rows = 0;          // rows (token, expert assignments) it has computed
  uint64_t resident_bytes = 0;
  uint64_t pid = 0;
  char host[64] = {};  // NUL-terminated
};
static_assert(sizeof(EpPong) == 104);

// Header size for a job: the fixed part plus one count per slot of the busiest rank, over all
// layers served.
inline size_t HeaderBytes(const Placement& p, const std::vector<int>& layers) {
  int most = 1;
  for (int l : layers) {
    if (const LayerPlacement* lp = p.Layer(l)) most = std::max(most, lp->MaxSlotsPerRank());
  }
  return sizeof(EpHeaderFixed) + sizeof(int32_t) * static_cast<size_t>(most);
}

inline int32_t* HeaderCounts(void* header) {
  return reinterpret_cast<int32_t*>(static_cast<char*>(header) + sizeof(EpHeaderFixed));
}

}  // namespace moerun
