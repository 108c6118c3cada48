#include "runtime/ep/stranded.h"

#include "runtime/ep/parked.h"

namespace moerun {

StrandedTransfers::~StrandedTransfers() {
  for (Group& g : groups_) {
    bool sends_left = false;
    for (Request& r : g.requests) {
      if (!r.valid()) continue;
      (void)t_->Cancel(r);
      sends_left = true;  // which of them were sends is not recorded: park conservatively
      r = Request{};
    }
    if (sends_left && !t_->can_withdraw_sends()) ParkForProcess(std::move(g.buffers));
  }
}

void StrandedTransfers::Add(std::vector<Request> requests, std::vector<AlignedBuffer> buffers) {
  groups_.push_back(Group{std::move(requests), std::move(buffers)});
}

void StrandedTransfers::Poll(const std::function<void(const Request&, const Status&)>& finished) {
  for (size_t i = 0; i < groups_.size();) {
    bool left = false;
    for (Request& r : groups_[i].requests) {
      if (!r.valid()) continue;
      Result<bool> done = t_->Test(r);
      if (!done.ok() || *done) {
        finished(r, done.ok() ? Status::Ok() : done.status());
        r = Request{};
      } else {
        left = true;
      }
    }
    if (left) {
      ++i;
    } else {
      for (AlignedBuffer& b : groups_[i].buffers) t_->UnregisterMemory(b.data());
      groups_.erase(groups_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
}

void StrandedTransfers::CancelPeer(int rank) {
  for (Group& g : groups_) {
    for (Request& q : g.requests) {
      if (!q.valid() || q.peer != rank) continue;
      (void)t_->Cancel(q);
      q = Request{};
    }
  }
}

bool StrandedTransfers::AnyPeer(const std::function<bool(int)>& pred) const {
  for (const Group& g : groups_) {
    for (const Request& r : g.requests) {
      if (r.valid() && pred(r.peer)) return true;
    }
  }
  return false;
}

}  // namespace moerun
