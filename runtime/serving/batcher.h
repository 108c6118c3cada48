// Dynamic batching on a router: requests from any thread are merged into batches of one layer,
// up to max_batch_tokens, or sent as they are once the oldest has waited max_wait_us; the
// router's thread runs each batch and hands every request its rows of the output.
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

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/dtype.h"
#include "base/function_ref.h"
#include "base/status.h"

namespace moerun {

struct BatcherOptions {
  int64_t max_batch_tokens = 256;
  int64_t max_wait_us = 500;
  int64_t max_queue_tokens = 65536;
  int max_queue_requests = 4096;
};

// What a request's callback learns besides its status.
struct BatchInfo {
  int64_t queue_us = 0;      // from Submit to the start of its batch
  int64_t compute_us = 0;    // of its batch
  int64_t batch_tokens = 0;  // tokens of its batch
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
  // does not fail the others; the caller answers each by its own deadline).
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  DType x_type = DType::kF32;    // kF32 or kBF16
  DType out_type = DType::kF32;  // kF32 or kBF16
};

struct BatcherStats {
  uint64_t batches = 0, requests = 0, tokens = 0, refused = 0, expired = 0;
  uint64_t nonfinite = 0;        // requests refused because their output was not finite
  uint64_t queued_requests = 0;  // now
  int64_t queued_tokens = 0;     // now
};

class Batcher {
 public:
  Batcher(BatcherOptions options, int64_t hidden);

  Status Submit(const BatchRequest& request);
  using Forward = FunctionRef<Status(int layer, const float* x, int64_t tokens, float* out,
                                     std::chrono::steady_clock::time_point deadline)>;
  // Runs batches until Stop (or `stop_requested` returns true) and the queue is empty.
  // forward(layer, x, tokens, out, deadline) computes one batch; `idle` runs between batches and
  // at least every `poll` while nothing is queued (stop_requested is polled as often).
  void Run(Forward forward, FunctionRef<bool()> stop_requested, FunctionRef<void()> idle,
           std::chrono::milliseconds poll = std::chrono::milliseconds(50));
  void Stop();
  BatcherStats stats() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Slot {
    BatchRequest req;
    Clock::time_point enqueued;
  };
  // Takes the next batch off the queue (lock held); false when nothing is ready. Requests past
  // their deadline go to expired_ instead.
  bool TakeBatch(std::vector<Slot>* batch, bool flush);
  void DropExpired(Clock::time_point now);

  const BatcherOptions opts_;
  const int64_t hidden_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> ring_;
  size_t head_ = 0, count_ = 0;
  int64_t queued_tokens_ = 0;
  bool stopping_ = false;
  BatcherStats stats_;
  std::vector<Slot> batch_, expired_;
  AlignedBuffer in_, out_;
};

}  // namespace moerun
