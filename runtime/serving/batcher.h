// Continuous batching on a router: requests from any thread are merged into batches of one
// layer, and no request ever waits for batch-mates. The router's thread takes whatever is queued
// the moment it is free (up to max_batch_tokens of the oldest request's layer, in arrival
// order), and while a batch runs, requests of its layer that arrive join it as its next
// microbatch whenever the router's two-stage pipeline has room (BatchStream,
// base/batch_stream.h); each request is answered as soon as its rows are final, not at the end
// of its batch. So a lone request is dispatched at once, and under load the next microbatch
// gathers while one runs (as vLLM's scheduler and Triton's dynamic batcher do).
// max_wait_us caps the growth under load: a batch takes newcomers for at most max_wait_us after
// it starts (and up to max_batch_tokens), then ends at a batch boundary, where the router polls
// its control (placement switches, health); 0: a batch is what was queued when it started.
// After a batch the router's thread looks for the next request for spin_us (yielding its core)
// before it sleeps, so that a client's next request is taken without a thread wake-up.
//
// Submit is thread-safe and allocates nothing: the request names the caller's input and output
// buffers (valid until its callback) and a plain callback. The input may be F32 or BF16 (a
// serving frame's data, in place) and the output likewise: gathering a batch decodes each
// request's rows once into the batcher's F32 batch, and handing the results back encodes them
// once into each request's output; those are the only copies of the hidden states. The queue is
// bounded (max_queue_tokens and a fixed number of requests): a full queue refuses with
// kResourceExhausted instead of growing. Run belongs to one thread; Stop makes it finish what is
// queued and return.
//
// An answer is never OK with non-finite values: after a request's rows are encoded into its
// output they are checked (F32 or BF16, as sent), and a request whose output holds a NaN or Inf
// (finite inputs so large that the layer's arithmetic overflows) is answered kInvalidArgument
// naming the cause; the other requests of its batch are answered as usual (rows are independent).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/batch_stream.h"
#include "base/dtype.h"
#include "base/function_ref.h"
#include "base/status.h"

namespace moerun {

// The "layer" of a transport probe (InferRequest.probe = PROBE_TRANSPORT): a batch of its own,
// which the router answers by sending its rows to each expert rank and back.
inline constexpr int kTransportProbeLayer = -2;

struct BatcherOptions {
  int64_t max_batch_tokens = 256;
  int64_t max_wait_us = 500;
  int64_t max_queue_tokens = 65536;
  int max_queue_requests = 4096;
  // After a batch, how long the router's thread keeps looking for the next request (yielding its
  // core) before it sleeps; 0: it sleeps at once.
  int64_t spin_us = 300;
};

// What a request's callback learns besides its status.
struct BatchInfo {
  int64_t queue_us = 0;      // from Submit to its rows joining a batch
  int64_t compute_us = 0;    // from then to its rows' outputs being final
  int64_t batch_tokens = 0;  // tokens of its batch (so far, when it was answered)
  // Where its batch's time went on the router so far (null when the forward reported none);
  // valid during the callback only.
  const BatchTiming* timing = nullptr;
};

struct BatchRequest {
  int layer = 0;
  const void* x = nullptr;  // [tokens][hidden] of x_type
  void* out = nullptr;      // [tokens][hidden] of out_type
  int64_t tokens = 0;
  void (*done)(void* ctx, const Status& status, const BatchInfo& info) = nullptr;
  void* ctx = nullptr;
  // A request still queued at its deadline is answered kDeadlineExceeded without computing it;
  // a batch's forward gets the latest deadline of its requests (so that one impatient request
  // does not fail the others; the caller answers each by its own deadline). A request whose
  // deadline leaves less time than its layer's fastest batch lately (Floor) is answered
  // kDeadlineExceeded at once (Submit refuses it; queued, it is dropped when batches are taken):
  // it could not be met, and is never dispatched to expire in flight.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  DType x_type = DType::kF32;    // kF32 or kBF16
  DType out_type = DType::kF32;  // kF32 or kBF16
};

struct BatcherStats {
  uint64_t batches = 0, requests = 0, tokens = 0, refused = 0, expired = 0;
  // Requests answered kDeadlineExceeded at once, their deadline shorter than their layer's
  // fastest batch lately (counted in expired too when they were queued).
  uint64_t too_short = 0;
  uint64_t nonfinite = 0;        // requests refused because their output was not finite
  uint64_t queued_requests = 0;  // now
  int64_t queued_tokens = 0;     // now
};

class Batcher {
 public:
  Batcher(BatcherOptions options, int64_t hidden);

  Status Submit(const BatchRequest& request);
  using Forward =
      FunctionRef<Status(int layer, const float* x, int64_t tokens, float* out,
                         std::chrono::steady_clock::time_point deadline, BatchStream* stream)>;
  // Runs batches until Stop (or `stop_requested` returns true) and the queue is empty.
  // forward(layer, x, tokens, out, deadline, stream) computes one batch; it may grow it through
  // `stream` (x and out have room for stream->tokens() rows; Extend takes newcomers) and should
  // report final rows with Done (the requests whose rows are final are answered then; the others
  // when forward returns). `idle` runs between batches and at least every `poll` while nothing
  // is queued (stop_requested is polled as often).
  void Run(Forward forward, FunctionRef<bool()> stop_requested, FunctionRef<void()> idle,
           std::chrono::milliseconds poll = std::chrono::milliseconds(50));
  void Stop();
  BatcherStats stats() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Slot {
    BatchRequest req;
    Clock::time_point enqueued;
    // Nonzero: expired because its deadline left less than this, its layer's floor.
    Clock::duration floor{};
  };
  // The fastest batch of a layer lately: the least time from a batch's start to its end over the
  // last 256 to 512 batches of the layer (a window of two halves, so that it follows the job).
  struct Floor {
    int64_t current_us = INT64_MAX, previous_us = INT64_MAX;
    uint32_t batches = 0;
    int64_t us() const { return std::min(current_us, previous_us); }
    void Add(int64_t us);
  };
  static constexpr int kFloorLayers = 256;  // layers 0..255 have a floor; others none
  // The layer's floor as a duration (zero when unknown) (lock held).
  Clock::duration FloorLocked(int layer) const;
  // Whether a request with this deadline cannot be met: less time left than its layer's floor
  // (lock held).
  bool TooShortLocked(const BatchRequest& r, Clock::time_point now) const;
  class Running;  // the batch being run, as a BatchStream
  // Moves queued requests of `layer` off the head of the queue into batch_ while they fit in
  // `room` tokens (at least one when `room` allows it and batch_ is empty) (lock held); returns
  // their tokens. Requests past their deadline go to expired_ instead.
  int64_t TakeLocked(int layer, int64_t room);
  void DropExpired(Clock::time_point now);
  void AnswerExpired();

  const BatcherOptions opts_;
  const int64_t hidden_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> ring_;
  size_t head_ = 0, count_ = 0;
  int64_t queued_tokens_ = 0;
  bool stopping_ = false;
  std::atomic<uint64_t> submitted_{0};  // requests queued so far (the idle spin watches it)
  Clock::time_point last_batch_end_{};  // Run's thread only
  BatcherStats stats_;
  std::array<Floor, kFloorLayers> floors_{};
  std::vector<Slot> batch_, expired_;
  std::vector<Clock::time_point> joined_;  // by batch_ index: when its rows joined the batch
  AlignedBuffer in_, out_;
};

}  // namespace moerun
