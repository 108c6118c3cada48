#include "runtime/serving/batcher.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

namespace moerun {
namespace {

// n values of `type` (F32 or BF16) -> F32.
void DecodeRows(const void* src, DType type, size_t n, float* dst) {
  if (type == DType::kF32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  const auto* s = static_cast<const char*>(src);
  for (size_t i = 0; i < n; ++i) {
    uint16_t v;
    std::memcpy(&v, s + 2 * i, 2);
    dst[i] = Bf16ToF32(v);
  }
}

// n F32 values -> `type` (F32, or BF16 rounded to nearest even).
void EncodeRows(const float* src, size_t n, DType type, void* dst) {
  if (type == DType::kF32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  auto* d = static_cast<char*>(dst);
  for (size_t i = 0; i < n; ++i) {
    const uint16_t v = F32ToBf16(src[i]);
    std::memcpy(d + 2 * i, &v, 2);
  }
}

// Whether all n values of `type` (F32 or BF16) are finite: an exponent of all ones is Inf or NaN.
// Branch-free over the values (one pass over rows just written, still in cache).
bool AllFinite(const void* data, size_t n, DType type) {
  uint32_t bad = 0;
  if (type == DType::kF32) {
    const auto* p = static_cast<const char*>(data);
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, p + 4 * i, 4);
      bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    }
  } else {
    const auto* p = static_cast<const char*>(data);
    for (size_t i = 0; i < n; ++i) {
      uint16_t bits;
      std::memcpy(&bits, p + 2 * i, 2);
      bad |= static_cast<uint32_t>((bits & 0x7f80u) == 0x7f80u);
    }
  }
  return bad == 0;
}

// The answer to a request whose output is not finite although its input is (the codec refuses
// NaN and Inf inputs): finite inputs this large overflow the layer's F32 arithmetic. Built only
// on this path (it allocates its message).
Status NonFiniteOutput(const float* x, size_t n) {
  float max_abs = 0;
  for (size_t i = 0; i < n; ++i) max_abs = std::max(max_abs, std::fabs(x[i]));
  char bound[32];
  std::snprintf(bound, sizeof bound, "%.2g", static_cast<double>(max_abs));
  return Status::InvalidArgument(
      std::string("the layer's output is not finite for this input (|x| up to ") + bound +
      "): inputs this large overflow the layer's float32 arithmetic (an expert's activation "
      "grows as |x| squared); scale the hidden states down");
}

// The answer to a request whose deadline cannot be met: less time left than its layer's
// fastest batch lately. Built only on this path.
Status TooShort(std::chrono::steady_clock::duration left,
                std::chrono::steady_clock::duration floor) {
  const auto us = [](std::chrono::steady_clock::duration d) {
    return std::to_string(
        std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::microseconds>(d).count()));
  };
  return Status::DeadlineExceeded(
      "the request's deadline leaves " + us(left) + " us, less than this layer's fastest answer " +
      "lately (" + us(floor) + " us): it cannot be met; not computed (give a longer deadline_ms)");
}

}  // namespace

Batcher::Batcher(BatcherOptions options, int64_t hidden)
    : opts_(options),
      hidden_(hidden),
      ring_(static_cast<size_t>(std::max(1, options.max_queue_requests))) {
  // A batch holds at most max_batch_tokens requests (each has a token at least), those queued
  // when it started and those it took as it grew: no growth allocates on the request path.
  const size_t most = std::max(
      ring_.size(), static_cast<size_t>(std::clamp<int64_t>(options.max_batch_tokens, 1, 65536)));
  batch_.reserve(most);
  joined_.reserve(most);
  expired_.reserve(ring_.size());
  // A full batch fits from the start (a single larger request grows them once).
  const size_t full =
      static_cast<size_t>(std::max<int64_t>(1, options.max_batch_tokens) * hidden) * sizeof(float);
  in_.Reserve(full);
  out_.Reserve(full);
}

Status Batcher::Submit(const BatchRequest& r) {
  if (r.tokens <= 0 || r.x == nullptr || r.out == nullptr || r.done == nullptr) {
    return Status::InvalidArgument("batcher: a request needs tokens, input, output and a callback");
  }
  const auto row_type = [](DType t) { return t == DType::kF32 || t == DType::kBF16; };
  if (!row_type(r.x_type) || !row_type(r.out_type)) {
    return Status::InvalidArgument("batcher: rows must be F32 or BF16");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return Status::Unavailable("the router is shutting down");
    if (count_ == ring_.size() || queued_tokens_ + r.tokens > opts_.max_queue_tokens) {
      ++stats_.refused;
      return Status::ResourceExhausted("the router's queue is full (" +
                                       std::to_string(queued_tokens_) + " tokens queued)");
    }
    const auto now = Clock::now();
    if (TooShortLocked(r, now)) {
      ++stats_.too_short;
      return TooShort(r.deadline - now, FloorLocked(r.layer));
    }
    ring_[(head_ + count_) % ring_.size()] = Slot{r, now};
    ++count_;
    queued_tokens_ += r.tokens;
  }
  submitted_.fetch_add(1, std::memory_order_relaxed);
  cv_.notify_one();
  return Status::Ok();
}

void Batcher::Floor::Add(int64_t us) {
  current_us = std::min(current_us, us);
  if (++batches == 256) {
    previous_us = current_us;
    current_us = INT64_MAX;
    batches = 0;
  }
}

Batcher::Clock::duration Batcher::FloorLocked(int layer) const {
  if (layer < 0 || layer >= kFloorLayers) return Clock::duration::zero();
  const int64_t us = floors_[static_cast<size_t>(layer)].us();
  return us == INT64_MAX ? Clock::duration::zero() : std::chrono::microseconds(us);
}

bool Batcher::TooShortLocked(const BatchRequest& r, Clock::time_point now) const {
  const Clock::duration floor = FloorLocked(r.layer);
  return floor > Clock::duration::zero() && r.deadline != Clock::time_point::max() &&
         r.deadline - now < floor;
}

void Batcher::DropExpired(Clock::time_point now) {
  // Compacts the ring, keeping FIFO order of the live requests.
  size_t kept = 0;
  for (size_t i = 0; i < count_; ++i) {
    Slot& s = ring_[(head_ + i) % ring_.size()];
    if (s.req.deadline <= now || TooShortLocked(s.req, now)) {
      s.floor = s.req.deadline > now ? FloorLocked(s.req.layer) : Clock::duration::zero();
      expired_.push_back(s);
      queued_tokens_ -= s.req.tokens;
      ++stats_.expired;
      if (s.floor > Clock::duration::zero()) ++stats_.too_short;
    } else {
      if (kept != i) ring_[(head_ + kept) % ring_.size()] = s;
      ++kept;
    }
  }
  count_ = kept;
}

int64_t Batcher::TakeLocked(int layer, int64_t room) {
  const auto now = Clock::now();
  DropExpired(now);
  int64_t taken = 0;
  while (count_ > 0) {
    const Slot& s = ring_[head_];
    if (s.req.layer != layer) break;  // arrival order is kept: a batch is one layer
    // A batch's first request goes whatever its size (its buffers grow once for it).
    if (taken + s.req.tokens > room && !batch_.empty()) break;
    batch_.push_back(s);
    joined_.push_back(now);
    head_ = (head_ + 1) % ring_.size();
    --count_;
    queued_tokens_ -= s.req.tokens;
    taken += s.req.tokens;
  }
  return taken;
}

void Batcher::AnswerExpired() {
  for (const Slot& s : expired_) {
    BatchInfo info;
    const auto now = Clock::now();
    info.queue_us = std::chrono::duration_cast<std::chrono::microseconds>(now - s.enqueued).count();
    s.req.done(s.req.ctx,
               s.floor > Clock::duration::zero()
                   ? TooShort(s.req.deadline - now, s.floor)
                   : Status::DeadlineExceeded("the deadline passed after " +
                                              std::to_string(info.queue_us) + " us in the queue"),
               info);
  }
  expired_.clear();
}

// The batch being run, as the layer's BatchStream: newcomers of its layer join it while the
// growth window (max_wait_us from its start) is open and room is left (max_batch_tokens, and the
// rows its input buffer holds: x must not move); requests are answered as their rows become
// final.
class Batcher::Running : public BatchStream {
 public:
  Running(Batcher& b, int layer, int64_t tokens, Clock::time_point started)
      : b_(b),
        layer_(layer),
        tokens_(tokens),
        grow_until_(started + std::chrono::microseconds(b.opts_.max_wait_us)),
        room_rows_(std::min<int64_t>(
            b.opts_.max_batch_tokens,
            static_cast<int64_t>(std::min(b.in_.size(), b.out_.size()) /
                                 (static_cast<size_t>(b.hidden_) * sizeof(float))))) {}

  int64_t Extend(int64_t /*tokens: tokens_*/, Deadline* deadline) override {
    if (tokens_ >= room_rows_ || b_.opts_.max_wait_us <= 0 || Clock::now() >= grow_until_) {
      return tokens_;
    }
    const size_t first = b_.batch_.size();
    {
      std::lock_guard<std::mutex> lock(b_.mu_);
      if (b_.count_ == 0) return tokens_;
      b_.TakeLocked(layer_, room_rows_ - tokens_);
    }
    b_.AnswerExpired();
    float* in = b_.in_.as<float>();
    for (size_t i = first; i < b_.batch_.size(); ++i) {
      const BatchRequest& r = b_.batch_[i].req;
      DecodeRows(r.x, r.x_type, static_cast<size_t>(r.tokens * b_.hidden_),
                 in + tokens_ * b_.hidden_);
      tokens_ += r.tokens;
      *deadline = std::max(*deadline, r.deadline);
    }
    return tokens_;
  }

  void Done(int64_t done, const BatchTiming& timing) override {
    timing_ = timing;
    have_timing_ = true;
    Answer(done, Status::Ok());
  }
  int64_t tokens() const override { return tokens_; }

  // Answers, in order, the requests whose rows [off, off + tokens) end at or before `done`: with
  // their rows when `status` is OK, else with `status`.
  void Answer(int64_t done, const Status& status) {
    const auto now = Clock::now();
    while (answered_ < b_.batch_.size()) {
      const Slot& s = b_.batch_[answered_];
      if (offset_ + s.req.tokens > done) break;
      const Status* answer = &status;
      Status refused;
      if (status.ok()) {
        // Rows are independent: a request whose rows overflowed is refused alone, its
        // batch-mates are answered as usual.
        const size_t n = static_cast<size_t>(s.req.tokens * b_.hidden_);
        EncodeRows(b_.out_.as<float>() + offset_ * b_.hidden_, n, s.req.out_type, s.req.out);
        if (!AllFinite(s.req.out, n, s.req.out_type)) {  // BF16 answers checked once rounded
          refused = NonFiniteOutput(b_.in_.as<float>() + offset_ * b_.hidden_, n);
          answer = &refused;
          ++nonfinite_;
        }
      }
      const auto joined = b_.joined_[answered_];
      BatchInfo info;
      info.batch_tokens = tokens_;
      info.queue_us =
          std::chrono::duration_cast<std::chrono::microseconds>(joined - s.enqueued).count();
      info.compute_us = std::chrono::duration_cast<std::chrono::microseconds>(now - joined).count();
      info.timing = have_timing_ ? &timing_ : nullptr;
      s.req.done(s.req.ctx, *answer, info);
      offset_ += s.req.tokens;
      ++answered_;
    }
  }
  uint64_t nonfinite() const { return nonfinite_; }

 private:
  Batcher& b_;
  const int layer_;
  int64_t tokens_;
  const Clock::time_point grow_until_;
  const int64_t room_rows_;
  BatchTiming
      timing_;  // the last the layer reported (its ranks are the layer's until its next run)
  bool have_timing_ = false;
  size_t answered_ = 0;  // requests of batch_ answered
  int64_t offset_ = 0;   // their tokens
  uint64_t nonfinite_ = 0;
};

void Batcher::Run(Forward forward, FunctionRef<bool()> stop_requested, FunctionRef<void()> idle,
                  std::chrono::milliseconds poll) {
  for (;;) {
    int layer = 0;
    int64_t tokens = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_requested()) stopping_ = true;
      batch_.clear();
      joined_.clear();
      // The router is free: whatever is queued goes now (no request waits for batch-mates).
      DropExpired(Clock::now());
      if (count_ > 0) {
        layer = ring_[head_].req.layer;
        tokens = TakeLocked(layer, opts_.max_batch_tokens);
      }
      if (tokens == 0 && stopping_ && count_ == 0 && expired_.empty()) return;
      if (tokens == 0 && expired_.empty()) {
        // Just after a batch the next request is likely near (a client's answer, its next
        // request): look for it a while, yielding the core, before sleeping; one that comes
        // then is taken without a thread wake-up (10-50 µs on a loaded or virtual machine).
        const auto spin_until = last_batch_end_ + std::chrono::microseconds(opts_.spin_us);
        if (Clock::now() < spin_until) {
          const uint64_t seen = submitted_.load(std::memory_order_relaxed);
          lock.unlock();
          while (submitted_.load(std::memory_order_relaxed) == seen && Clock::now() < spin_until &&
                 !stop_requested()) {
            sched_yield();
          }
          lock.lock();
        }
        if (count_ == 0) cv_.wait_until(lock, Clock::now() + poll);
      }
    }
    AnswerExpired();
    if (tokens == 0) {
      idle();
      continue;
    }
    // Gather, run (the batch may grow), answer what the run did not.
    const auto started = Clock::now();
    auto deadline = Clock::time_point::min();
    for (const Slot& s : batch_) deadline = std::max(deadline, s.req.deadline);
    const size_t full =
        static_cast<size_t>(std::max(tokens, opts_.max_batch_tokens) * hidden_) * sizeof(float);
    in_.Reserve(full);
    out_.Reserve(full);
    float* in = in_.as<float>();
    int64_t off = 0;
    for (const Slot& s : batch_) {
      DecodeRows(s.req.x, s.req.x_type, static_cast<size_t>(s.req.tokens * hidden_),
                 in + off * hidden_);
      off += s.req.tokens;
    }
    Running run(*this, layer, tokens, started);
    const Status st = forward(layer, in, tokens, out_.as<float>(), deadline, &run);
    run.Answer(run.tokens(), st);
    last_batch_end_ = Clock::now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (st.ok() && layer >= 0 && layer < kFloorLayers) {
        floors_[static_cast<size_t>(layer)].Add(
            std::chrono::duration_cast<std::chrono::microseconds>(last_batch_end_ - started)
                .count());
      }
      ++stats_.batches;
      stats_.requests += batch_.size();
      stats_.tokens += static_cast<uint64_t>(run.tokens());
      stats_.nonfinite += run.nonfinite();
    }
    idle();
  }
}

void Batcher::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
}

BatcherStats Batcher::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  BatcherStats s = stats_;
  s.queued_requests = count_;
  s.queued_tokens = queued_tokens_;
  return s;
}

}  // namespace moerun
