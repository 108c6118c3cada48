// The expert-parallel wire protocol between a router rank and an expert rank.
//
// Per microbatch, for each expert rank that gets rows: the router sends a header (fixed size for
// the job: HeaderBytes) with one entry per slot of the rank (in the rank's slot order): the
// logical expert and its row count; then the rows themselves (rows x hidden F32, entry after
// entry); the expert rank answers with the same number of rows, in the same order, each the
// expert's output for that row, then an EpResultTrailer in the same message: whether the rows
// are the answer (an expert the rank needs did not load in time, or failed to load: the rank
// says so and lives on; the router sends the microbatch again or fails the batch). The header
// names the experts, so an expert rank needs no copy of
// the router's placement: it computes whatever experts it holds, and a router can switch to a new
// placement at a batch boundary once the expert ranks hold the new copies. Messages between one
// router and one expert rank keep their order, so several microbatches can be in flight.
// A header of kind kShutdown ends the expert rank's service for that router. A header of kind
// kPing asks for an EpPong on kTagPong; since an expert rank handles one router's messages in
// order, the pong also says that every earlier microbatch of that router has been answered.
// A header of kind kControl carries an operation (load or free experts, new expert weights, ...)
// as JSON on kTagRows (`rows` is its length, `seq` its id), in order with the microbatches; its
// answers go back as control messages (EpControlHeader on kTagControl, then the JSON body on
// kTagControlBody), which is also how routers talk to each other.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "router/placement.h"

namespace moerun {

inline constexpr int kTagHeader = 11;
inline constexpr int kTagRows = 12;
inline constexpr int kTagResult = 13;
inline constexpr int kTagPong = 14;
inline constexpr int kTagControl = 15;
inline constexpr int kTagControlBody = 16;
inline constexpr uint32_t kEpMagic = 0x45454f4d;  // "MOEE"

// kEcho: `rows` x `hidden` floats follow on kTagRows; the expert rank sends them back as a
// result (rows, then a trailer) without computing anything: the floor of a dispatch's round
// trip (moebench serve --floor).
enum class EpKind : uint32_t { kDispatch = 1, kShutdown = 2, kPing = 3, kControl = 4, kEcho = 5 };
// The most bytes an echo may carry.
inline constexpr int64_t kMaxEchoBytes = int64_t{256} << 20;

struct EpHeaderFixed {
  uint32_t magic = kEpMagic;
  uint32_t kind = 0;
  int32_t layer = 0;
  uint32_t seq = 0;
  int64_t rows = 0;
  int32_t hidden = 0;
  int32_t slots = 0;  // entries that follow
};
static_assert(sizeof(EpHeaderFixed) == 32);

// One slot of a dispatch header: the logical expert and the rows for it.
struct EpEntry {
  int32_t expert = 0;
  int32_t rows = 0;
};

// Precedes a control message's JSON body (kTagControlBody, exactly `bytes` long).
struct EpControlHeader {
  uint32_t magic = kEpMagic;
  uint32_t reserved = 0;
  uint64_t bytes = 0;
};
static_assert(sizeof(EpControlHeader) == 16);
inline constexpr uint64_t kMaxControlBytes = 16u << 20;

inline std::vector<char> ControlHeaderFor(const std::string& body) {
  EpControlHeader h;
  h.bytes = body.size();
  std::vector<char> out(sizeof h);
  std::memcpy(out.data(), &h, sizeof h);
  return out;
}

// An expert rank's answer to kPing: the ping's seq and what the rank reports of itself.
struct EpPong {
  uint32_t magic = kEpMagic;
  uint32_t seq = 0;
  uint64_t microbatches = 0;  // microbatches it has computed, for every router
  uint64_t rows = 0;          // rows (token, expert assignments) it has computed
  uint64_t resident_bytes = 0;
  uint64_t pid = 0;
  char host[64] = {};  // NUL-terminated
  // Its expert cache (all 0 without one): budget, resident bytes, hits and misses since the
  // start, experts hosted and resident.
  uint64_t cache_budget_bytes = 0;
  uint64_t cache_resident_bytes = 0;
  uint64_t cache_hits = 0;
  uint64_t cache_misses = 0;
  uint32_t cache_hosted = 0;
  uint32_t cache_resident = 0;
  uint64_t busy_us = 0;  // time computing its microbatches (cache waits left out), since the start
  uint64_t memory_budget_bytes = 0;  // the most expert weights it may hold (0: no limit)
};
static_assert(sizeof(EpPong) == 160);

// Ends every result message (kTagResult), right after the rows: `code` 0 (StatusCode::kOk) when
// the rows are the answer; otherwise the rows mean nothing and `message` says why (NUL-
// terminated). kResultRetry: an expert the microbatch needs is still loading (the same rows sent
// again later are answered once it is resident).
struct EpResultTrailer {
  uint32_t magic = kEpMagic;
  uint32_t seq = 0;  // the dispatch header's
  int32_t code = 0;  // a StatusCode
  uint32_t flags = 0;
  uint32_t compute_us = 0;  // the rank's own time for the microbatch: its rows in to its answer out
  uint32_t cache_wait_us = 0;  // of which waiting for the expert cache's loads
  // The rank's own clock, in ns since the Unix epoch (traces; each rank's clock, not the
  // router's): its header taken, its compute started, its answer sent.
  int64_t header_ns = 0;
  int64_t compute_start_ns = 0;
  int64_t answer_ns = 0;
  char message[104] = {};
  char reserved[40] = {};
};
static_assert(sizeof(EpResultTrailer) == 192);
inline constexpr uint32_t kResultRetry = 1;
// Floats between two ranks' result blocks in the router's receive buffer: one trailer's room
// (a multiple of 16 floats, so every block stays 64-byte aligned).
inline constexpr int64_t kResultGapFloats = sizeof(EpResultTrailer) / sizeof(float);
static_assert(kResultGapFloats % 16 == 0);

// Slots per expert rank a job's headers hold: the busiest rank's over all layers served, and at
// least one per logical expert, so that any later placement without doubled experts fits.
inline int HeaderSlots(const Placement& p, const std::vector<int>& layers) {
  int most = std::max(1, std::min(p.num_experts(), Placement::kMaxSlotsPerRank));
  for (int l : layers) {
    if (const LayerPlacement* lp = p.Layer(l)) most = std::max(most, lp->MaxSlotsPerRank());
  }
  return most;
}

// Header size for a job: the fixed part plus HeaderSlots entries.
inline size_t HeaderBytes(const Placement& p, const std::vector<int>& layers) {
  return sizeof(EpHeaderFixed) + sizeof(EpEntry) * static_cast<size_t>(HeaderSlots(p, layers));
}

inline EpEntry* HeaderEntries(void* header) {
  return reinterpret_cast<EpEntry*>(static_cast<char*>(header) + sizeof(EpHeaderFixed));
}
inline const EpEntry* HeaderEntries(const void* header) {
  return reinterpret_cast<const EpEntry*>(static_cast<const char*>(header) + sizeof(EpHeaderFixed));
}

}  // namespace moerun
