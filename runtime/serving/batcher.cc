#include "runtime/serving/batcher.h"

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

}  // namespace

Batcher::Batcher(BatcherOptions options, int64_t hidden)
    : opts_(options),
      hidden_(hidden),
      ring_(static_cast<size_t>(std::max(1, options.max_queue_requests))) {
  batch_.reserve(ring_.size());
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
    ring_[(head_ + count_) % ring_.size()] = Slot{r, Clock::now()};
    ++count_;
    queued_tokens_ += r.tokens;
  }
  cv_.notify_one();
  return Status::Ok();
}

void Batcher::DropExpired(Clock::time_point now) {
  // Compacts the ring, keeping FIFO order of the live requests.
  size_t kept = 0;
  for (size_t i = 0; i < count_; ++i) {
    Slot& s = ring_[(head_ + i) % ring_.size()];
    if (s.req.deadline <= now) {
      expired_.push_back(s);
      queued_tokens_ -= s.req.tokens;
    } else {
      if (kept != i) ring_[(head_ + kept) % ring_.size()] = s;
      ++kept;
    }
  }
  count_ = kept;
}

bool Batcher::TakeBatch(std::vector<Slot>* batch, bool flush) {
  batch->clear();
  const auto now = Clock::now();
  DropExpired(now);
  if (count_ == 0) return false;
  const Slot& first = ring_[head_];
  // Tokens of the head's layer that can go together, in FIFO order.
  int64_t tokens = 0;
  size_t n = 0;
  for (; n < count_; ++n) {
    const Slot& s = ring_[(head_ + n) % ring_.size()];
    if (s.req.layer != first.req.layer) break;
    if (n > 0 && tokens + s.req.tokens > opts_.max_batch_tokens) break;
    tokens += s.req.tokens;
  }
  const bool full = tokens >= opts_.max_batch_tokens || n < count_;
  const bool waited = now - first.enqueued >= std::chrono::microseconds(opts_.max_wait_us);
  if (!full && !waited && !flush) return false;
  for (size_t i = 0; i < n; ++i) {
    batch->push_back(ring_[head_]);
    head_ = (head_ + 1) % ring_.size();
    --count_;
    queued_tokens_ -= batch->back().req.tokens;
  }
  return true;
}

void Batcher::Run(Forward forward, FunctionRef<bool()> stop_requested, FunctionRef<void()> idle,
                  std::chrono::milliseconds poll) {
  auto answer_expired = [&] {
    for (const Slot& s : expired_) {
      BatchInfo info;
      info.queue_us =
          std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - s.enqueued).count();
      s.req.done(s.req.ctx,
                 Status::DeadlineExceeded("the deadline passed after " +
                                          std::to_string(info.queue_us) + " us in the queue"),
                 info);
    }
    expired_.clear();
  };
  for (;;) {
    bool have = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_requested()) stopping_ = true;
      have = TakeBatch(&batch_, stopping_);
      stats_.expired += expired_.size();
      if (!have && stopping_ && count_ == 0 && expired_.empty()) return;
      if (!have && expired_.empty()) {
        auto until = Clock::now() + poll;
        if (count_ > 0) {
          until =
              std::min(until, ring_[head_].enqueued + std::chrono::microseconds(opts_.max_wait_us));
        }
        cv_.wait_until(lock, until);
      }
    }
    answer_expired();
    if (!have) {
      idle();
      continue;
    }
    // Gather, run, scatter.
    const auto started = Clock::now();
    int64_t tokens = 0;
    auto deadline = Clock::time_point::min();
    for (const Slot& s : batch_) {
      tokens += s.req.tokens;
      deadline = std::max(deadline, s.req.deadline);
    }
    const size_t bytes = static_cast<size_t>(tokens * hidden_) * sizeof(float);
    in_.Reserve(bytes);
    out_.Reserve(bytes);
    float* in = in_.as<float>();
    int64_t off = 0;
    for (const Slot& s : batch_) {
      DecodeRows(s.req.x, s.req.x_type, static_cast<size_t>(s.req.tokens * hidden_),
                 in + off * hidden_);
      off += s.req.tokens;
    }
    const Status st = forward(batch_.front().req.layer, in, tokens, out_.as<float>(), deadline);
    const auto finished = Clock::now();
    BatchInfo info;
    info.batch_tokens = tokens;
    info.compute_us =
        std::chrono::duration_cast<std::chrono::microseconds>(finished - started).count();
    off = 0;
    uint64_t nonfinite = 0;
    for (const Slot& s : batch_) {
      // Rows are independent: a request whose rows overflowed is refused alone, its batch-mates
      // are answered as usual.
      const Status* answer = &st;
      Status refused;
      if (st.ok()) {
        const size_t n = static_cast<size_t>(s.req.tokens * hidden_);
        EncodeRows(out_.as<float>() + off * hidden_, n, s.req.out_type, s.req.out);
        if (!AllFinite(s.req.out, n, s.req.out_type)) {  // BF16 answers checked once rounded
          refused = NonFiniteOutput(in + off * hidden_, n);
          answer = &refused;
          ++nonfinite;
        }
      }
      off += s.req.tokens;
      info.queue_us =
          std::chrono::duration_cast<std::chrono::microseconds>(started - s.enqueued).count();
      s.req.done(s.req.ctx, *answer, info);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.batches;
      stats_.requests += batch_.size();
      stats_.tokens += static_cast<uint64_t>(tokens);
      stats_.nonfinite += nonfinite;
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
