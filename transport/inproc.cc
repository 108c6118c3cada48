#include "transport/inproc.h"

#include <cstdlib>
#include <cstring>

#include "base/log.h"

namespace moerun {
namespace {

constexpr size_t kInitialOps = 4096;

uint64_t MakeId(uint32_t index, uint32_t generation) {
  return (static_cast<uint64_t>(generation) << 32) | (index + 1u);
}

}  // namespace

class InprocTransport : public Transport {
 public:
  InprocTransport(std::shared_ptr<InprocFabric> fabric, int rank)
      : fabric_(std::move(fabric)), rank_(rank) {}

  const char* name() const override { return "inproc"; }
  int rank() const override { return rank_; }
  int size() const override { return fabric_->size(); }

  Result<Request> Isend(int peer, int tag, const void* buf, size_t bytes) override {
    CountSent(peer, bytes);
    return fabric_->Post(true, rank_, peer, tag, buf, nullptr, bytes);
  }
  Result<Request> Irecv(int peer, int tag, void* buf, size_t bytes) override {
    return fabric_->Post(false, rank_, peer, tag, nullptr, buf, bytes);
  }
  Result<bool> Test(Request r) override { return fabric_->Test(rank_, r); }
  bool WaitForActivity(std::chrono::microseconds max) override {
    return fabric_->WaitForRing(rank_, &seen_, max);
  }
  bool wakes_on_arrival() const override { return true; }
  Status Cancel(Request r) override { return fabric_->Cancel(rank_, r); }
  // Every message this rank received was copied once, from the sender's buffer into its own.
  TransportCounters counters() const override {
    TransportCounters c;
    c.copied_bytes = fabric_->copied_bytes(rank_);
    return c;
  }
  [[noreturn]] void Abort(int exit_code) override {
    spdlog::error("inproc rank {} aborts the job (exit code {})", rank_, exit_code);
    spdlog::default_logger()->flush();
    std::_Exit(exit_code);
  }

 private:
  std::shared_ptr<InprocFabric> fabric_;
  int rank_;
  uint64_t seen_ = 0;
};

std::shared_ptr<InprocFabric> InprocFabric::Create(int ranks) {
  return std::shared_ptr<InprocFabric>(new InprocFabric(ranks));
}

InprocFabric::InprocFabric(int ranks)
    : ranks_(ranks),
      pending_sends_(static_cast<size_t>(ranks)),
      pending_recvs_(static_cast<size_t>(ranks)),
      frozen_(static_cast<size_t>(ranks), false),
      copied_(std::make_unique<std::atomic<uint64_t>[]>(static_cast<size_t>(ranks))),
      bells_(std::make_unique<Bell[]>(static_cast<size_t>(ranks))) {
  ops_.resize(kInitialOps);
  free_.reserve(kInitialOps);
  for (uint32_t i = kInitialOps; i > 0; --i) free_.push_back(i - 1);
  for (auto& v : pending_sends_) v.reserve(kInitialOps);
  for (auto& v : pending_recvs_) v.reserve(kInitialOps);
}

std::unique_ptr<Transport> InprocFabric::Endpoint(int rank) {
  return std::make_unique<InprocTransport>(shared_from_this(), rank);
}

void InprocFabric::Ring(int rank) {
  Bell& b = bells_[static_cast<size_t>(rank)];
  {
    std::lock_guard<std::mutex> lock(b.mu);
    ++b.rung;
  }
  b.cv.notify_all();
}

bool InprocFabric::WaitForRing(int rank, uint64_t* seen, std::chrono::microseconds max) {
  Bell& b = bells_[static_cast<size_t>(rank)];
  std::unique_lock<std::mutex> lock(b.mu);
  const bool rung = b.cv.wait_for(lock, max, [&] { return b.rung != *seen; });
  *seen = b.rung;
  return rung;
}

void InprocFabric::Freeze(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  frozen_[static_cast<size_t>(rank)] = true;
}

void InprocFabric::Complete(Op& s, Op& r) {
  if (s.bytes != r.bytes) {
    s.state = r.state = State::kFailed;
    s.other_bytes = r.bytes;
    r.other_bytes = s.bytes;
  } else {
    if (s.bytes > 0) std::memcpy(r.rbuf, s.sbuf, s.bytes);
    copied_[static_cast<size_t>(r.dst)].fetch_add(s.bytes, std::memory_order_relaxed);
    s.state = r.state = State::kDone;
  }
}

void InprocFabric::Thaw(int rank) {
  ThawLocked(rank);
  for (int r = 0; r < ranks_; ++r) Ring(r);
}

void InprocFabric::ThawLocked(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  frozen_[static_cast<size_t>(rank)] = false;
  for (int dst = 0; dst < ranks_; ++dst) {
    auto& sends = pending_sends_[static_cast<size_t>(dst)];
    auto& recvs = pending_recvs_[static_cast<size_t>(dst)];
    for (size_t i = 0; i < sends.size();) {
      Op& s = ops_[sends[i]];
      bool matched = false;
      if (s.src == rank) {
        for (size_t j = 0; j < recvs.size(); ++j) {
          Op& r = ops_[recvs[j]];
          if (r.src != s.src || r.dst != s.dst || r.tag != s.tag) continue;
          Complete(s, r);
          recvs.erase(recvs.begin() + static_cast<std::ptrdiff_t>(j));
          matched = true;
          break;
        }
      }
      if (matched) {
        sends.erase(sends.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }
}

InprocFabric::Op* InprocFabric::Find(Request r) {
  const uint64_t index = (r.id & 0xffffffffu) - 1;
  if (r.id == 0 || index >= ops_.size()) return nullptr;
  Op& op = ops_[index];
  if (op.generation != static_cast<uint32_t>(r.id >> 32) || op.state == State::kFree)
    return nullptr;
  return &op;
}

void InprocFabric::Release(uint32_t index) {
  Op& op = ops_[index];
  op.state = State::kFree;
  ++op.generation;
  free_.push_back(index);
}

Result<Request> InprocFabric::Post(bool send, int me, int peer, int tag, const void* sbuf,
                                   void* rbuf, size_t bytes) {
  if (peer < 0 || peer >= ranks_) {
    return Status::InvalidArgument("inproc: no rank " + std::to_string(peer));
  }
  // The peer learns of it: a send's receiver looks for the message, a matched receive's sender
  // sees its send complete.
  bool matched = false;
  Result<Request> r = PostLocked(send, me, peer, tag, sbuf, rbuf, bytes, &matched);
  if (r.ok() && (send || matched)) Ring(peer);
  return r;
}

Result<Request> InprocFabric::PostLocked(bool send, int me, int peer, int tag, const void* sbuf,
                                         void* rbuf, size_t bytes, bool* matched) {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) {  // grow the pool (only under a burst larger than any seen before)
    const uint32_t old = static_cast<uint32_t>(ops_.size());
    ops_.resize(old * 2);
    for (uint32_t i = old * 2; i > old; --i) free_.push_back(i - 1);
  }
  const uint32_t index = free_.back();
  free_.pop_back();
  Op& op = ops_[index];
  op.state = State::kPending;
  op.send = send;
  op.src = send ? me : peer;
  op.dst = send ? peer : me;
  op.tag = tag;
  op.sbuf = sbuf;
  op.rbuf = rbuf;
  op.bytes = bytes;
  op.other_bytes = 0;
  const Request req{MakeId(index, op.generation), peer};

  // Match against the other side's pending operations, oldest first.
  auto& others =
      send ? pending_recvs_[static_cast<size_t>(peer)] : pending_sends_[static_cast<size_t>(me)];
  const bool src_frozen = frozen_[static_cast<size_t>(op.src)];
  if (!src_frozen) {
    for (size_t i = 0; i < others.size(); ++i) {
      Op& o = ops_[others[i]];
      if (o.src != op.src || o.dst != op.dst || o.tag != tag) continue;
      Complete(send ? op : o, send ? o : op);
      others.erase(others.begin() + static_cast<std::ptrdiff_t>(i));
      *matched = true;
      return req;
    }
  }
  (send ? pending_sends_[static_cast<size_t>(peer)] : pending_recvs_[static_cast<size_t>(me)])
      .push_back(index);
  return req;
}

Result<bool> InprocFabric::Test(int me, Request r) {
  std::lock_guard<std::mutex> lock(mu_);
  Op* op = Find(r);
  if (op == nullptr) return Status::InvalidArgument("inproc: unknown request");
  (void)me;
  if (op->state == State::kPending) return false;
  const uint32_t index = static_cast<uint32_t>((r.id & 0xffffffffu) - 1);
  if (op->state == State::kFailed) {
    const Status s = Status::InvalidArgument(
        "message of " + std::to_string(op->send ? op->bytes : op->other_bytes) +
        " bytes where the receiver expected " +
        std::to_string(op->send ? op->other_bytes : op->bytes));
    Release(index);
    return s;
  }
  Release(index);
  return true;
}

Status InprocFabric::Cancel(int me, Request r) {
  std::lock_guard<std::mutex> lock(mu_);
  Op* op = Find(r);
  if (op == nullptr) return Status::Ok();
  const uint32_t index = static_cast<uint32_t>((r.id & 0xffffffffu) - 1);
  if (op->state == State::kPending) {
    auto& list = op->send ? pending_sends_[static_cast<size_t>(op->dst)]
                          : pending_recvs_[static_cast<size_t>(me)];
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i] == index) {
        list.erase(list.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
    }
  }
  Release(index);
  return Status::Ok();
}

}  // namespace moerun
