// BatchStream: a batch that grows while it runs (continuous batching). The serving loop hands a
// layer a batch; between two of the layer's microbatches, whenever its pipeline has room, the
// layer asks the stream for more rows (requests that arrived meanwhile, appended to the same
// input buffer) and tells it which tokens are final, so that their requests are answered at
// once rather than at the end of the batch. A lone request therefore never waits for
// batch-mates, and requests that arrive while one runs join it as its next microbatch.
//
// Thread-safety: called by the thread that runs the layer (the router's), only during the call
// that was given the stream.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>

namespace moerun {

// One expert rank's part of a batch so far (summed over its microbatches).
struct RankTiming {
  int32_t rank = 0;
  int64_t rows = 0;           // rows (token, expert) it got
  int64_t round_trip_us = 0;  // from its header's send to its answer received
  int64_t compute_us = 0;     // its own time, as its answers reported
};

// When one microbatch's parts began on the router (its steady clock), for traces.
struct MicrobatchTimes {
  using TimePoint = std::chrono::steady_clock::time_point;
  int32_t layer = 0;
  uint32_t seq = 0;
  int64_t tokens = 0;
  uint64_t placement_version = 0;  // the placement it was dispatched by
  TimePoint gate{}, dispatch{}, sent{}, wait{}, combine{}, end{};  // `end`: combined
};

// One expert rank's part of one microbatch, for traces: the router's times (its steady clock)
// and the rank's own (ns since the Unix epoch on the rank's clock, from its answer's trailer).
struct RankTimes {
  int32_t microbatch = 0;  // index into BatchTiming::microbatches
  int32_t rank = 0;
  int64_t rows = 0;
  int64_t bytes = 0;                                         // rows sent and answered
  std::chrono::steady_clock::time_point sent{}, received{};  // header sent, answer received
  int64_t header_ns = 0, compute_start_ns = 0, answer_ns = 0;
  int64_t cache_wait_us = 0;
  // The rank's clock minus the router's, as the router estimates it from its round trips with
  // the rank (NTP's rule on the round trip with the least delay lately); 0 for one host's ranks.
  int64_t clock_offset_ns = 0;
};

// Where a batch's time went on the router so far (summed over its microbatches); the shared
// expert runs while the expert ranks work, so it overlaps wait_us.
struct BatchTiming {
  int64_t gate_us = 0;                // gate, top-k and the dispatch plan
  int64_t dispatch_us = 0;            // gathering the rows and posting the sends
  int64_t wait_us = 0;                // waiting for the expert ranks' answers
  int64_t combine_us = 0;             // combining the answers
  int64_t shared_us = 0;              // the shared expert
  std::span<const RankTiming> ranks;  // the expert ranks that got rows, by rank
  // The batch's microbatches so far and each expert rank's part of them (at most
  // kMaxTracedMicrobatches: the first ones), for traces.
  std::span<const MicrobatchTimes> microbatches;
  std::span<const RankTimes> rank_times;
  // When the batch waited for experts whose every copy had died to be placed again (both unset:
  // it did not); its microbatches are then those of the call after the wait.
  std::chrono::steady_clock::time_point replaced_wait_from{}, replaced_wait_to{};
};
inline constexpr int kMaxTracedMicrobatches = 64;
// At most this many RankTimes per batch (the first ones: a trace of a job of many ranks names
// the expert ranks of its first microbatches).
inline constexpr int kMaxTracedRankTimes = 4096;

class BatchStream {
 public:
  using Deadline = std::chrono::steady_clock::time_point;
  virtual ~BatchStream() = default;
  // Appends the rows of whatever has arrived (and fits) after the batch's `tokens` rows in its
  // input buffer and returns the batch's token count now (at least `tokens`); raises
  // *deadline to the latest deadline of the requests it took.
  virtual int64_t Extend(int64_t tokens, Deadline* deadline) = 0;
  // The outputs of the batch's tokens [0, done) are final (done only grows); `timing`: the batch's
  // so far (valid during the call).
  virtual void Done(int64_t done, const BatchTiming& timing) = 0;
  // The batch's token count now.
  virtual int64_t tokens() const = 0;
};

}  // namespace moerun
