// Dynamic batching on a router: requests from any thread are merged into batches of one layer,
// up to max_batch_tokens, or sent as they are once the oldest has waited max_wait_us; the
// router's thread runs each batch and hands every request its rows of the output.
//
// Submit is thread-safe and allocates nothing: the request names the caller's input and output
// buffers (valid until its callback) and a plain callback. The queue is bounded (max_queue_tokens
// and a fixed number of requests): a full queue refuses with kResourceExhausted instead of
// growing. Run belongs to one thread; Stop makes it finish what is queued and return.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "experts/cpu/aligned_buffer.h"
#include "runtime/function_ref.h"
#include "runtime/status.h"

namespace moerun {

struct BatcherOptions {
  int64_t max_batch_tokens = 256;
  int64_t max_wait_us = 500;
  int64_t max_queue_tokens = 65536;
  int max_queue_requests = 4096;
};

struct BatchRequest {
  int layer = 0;
  const float* x = nullptr;  // [tokens][hidden]
  float* out = nullptr;      // [tokens][hidden]
  int64_t tokens = 0;
  void (*done)(void* ctx, const Status& status) = nullptr;
  void* ctx = nullptr;
};

struct BatcherStats {
  uint64_t batches = 0, requests = 0, tokens = 0, refused = 0;
};

class Batcher {
 public:
  Batcher(BatcherOptions options, int64_t hidden);

  Status Submit(const BatchRequest& request);
  // Runs batches until Stop (or `stop_requested` returns true, polled every 100 ms) and the queue
  // is empty. forward(layer, x, tokens, out) computes one batch.
  void Run(FunctionRef<Status(int, const float*, int64_t, float*)> forward,
           FunctionRef<bool()> stop_requested);
  void Stop();
  BatcherStats stats() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Slot {
    BatchRequest req;
    Clock::time_point enqueued;
  };
  // Takes the next batch off the queue (lock held); false when nothing is ready.
  bool TakeBatch(std::vector<Slot>* batch, bool flush);

  const BatcherOptions opts_;
  const int64_t hidden_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> ring_;
  size_t head_ = 0, count_ = 0;
  int64_t queued_tokens_ = 0;
  bool stopping_ = false;
  BatcherStats stats_;
  std::vector<Slot> batch_;
  AlignedBuffer in_, out_;
};

}  // namespace moerun
