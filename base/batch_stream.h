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

namespace moerun {

class BatchStream {
 public:
  using Deadline = std::chrono::steady_clock::time_point;
  virtual ~BatchStream() = default;
  // Appends the rows of whatever has arrived (and fits) after the batch's `tokens` rows in its
  // input buffer and returns the batch's token count now (at least `tokens`); raises
  // *deadline to the latest deadline of the requests it took.
  virtual int64_t Extend(int64_t tokens, Deadline* deadline) = 0;
  // The outputs of the batch's tokens [0, done) are final (done only grows).
  virtual void Done(int64_t done) = 0;
  // The batch's token count now.
  virtual int64_t tokens() const = 0;
};

}  // namespace moerun
