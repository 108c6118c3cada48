#include "transport/nccl/nccl_bulk.h"

#include <algorithm>
#include <string>

namespace moerun {

NcclPath PathOf(std::span<const int> bulk_tags, int /*self*/, int /*peer*/, int tag) {
  return std::find(bulk_tags.begin(), bulk_tags.end(), tag) != bulk_tags.end()
             ? NcclPath::kNccl
             : NcclPath::kBootstrap;
}

Status CheckEnvelope(const BulkEnvelope& e, int peer, uint64_t expected_seq,
                     std::span<const int> bulk_tags) {
  const std::string from = "nccl: envelope from rank " + std::to_string(peer);
  if (e.magic != kBulkEnvelopeMagic) {
    return Status::Corrupt(from + " has a bad magic number: is every rank the same moerun?");
  }
  if (std::find(bulk_tags.begin(), bulk_tags.end(), e.tag) == bulk_tags.end()) {
    return Status::Corrupt(from + " names tag " + std::to_string(e.tag) +
                           ", which is not one of this job's NCCL tags (do all ranks use the "
                           "same --transport?)");
  }
  if (e.seq != expected_seq) {
    return Status::Corrupt(from + " is message " + std::to_string(e.seq) + ", expected " +
                           std::to_string(expected_seq));
  }
  return Status::Ok();
}

std::optional<BulkMatcher::Unexpected> BulkMatcher::Post(uint64_t id, int tag, uint64_t bytes) {
  for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
    if (it->tag == tag) {
      Unexpected u = *it;
      unexpected_.erase(it);
      return u;
    }
  }
  posted_.push_back({id, tag, bytes});
  return std::nullopt;
}

std::optional<BulkMatcher::Posted> BulkMatcher::Arrive(int tag, uint64_t bytes, uint64_t handle) {
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    if (it->tag == tag) {
      Posted p = *it;
      posted_.erase(it);
      return p;
    }
  }
  unexpected_.push_back({handle, tag, bytes});
  return std::nullopt;
}

bool BulkMatcher::Withdraw(uint64_t id) {
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    if (it->id == id) {
      posted_.erase(it);
      return true;
    }
  }
  return false;
}

void PlanFlush(int self, std::span<const BulkOp> queued, std::vector<GroupedBulkOp>& out) {
  out.clear();
  for (const BulkOp& op : queued) {
    if (op.bytes == 0) continue;
    const int comm =
        op.kind == BulkOp::Kind::kSend ? NcclCommOf(self, op.peer) : NcclCommOf(op.peer, self);
    out.push_back({op, comm});
  }
}

size_t StagingPool::CapacityFor(size_t bytes) {
  const size_t n = std::max<size_t>(bytes, 1);
  return (n + kStagingGranule - 1) / kStagingGranule * kStagingGranule;
}

StagingPool::Grant StagingPool::Acquire(size_t bytes) {
  const size_t want = CapacityFor(bytes);
  int fit = -1, largest = -1;
  for (int i = 0; i < slots(); ++i) {
    const Slot& s = slots_[static_cast<size_t>(i)];
    if (s.in_use) continue;
    if (s.capacity >= want && (fit < 0 || s.capacity < slots_[static_cast<size_t>(fit)].capacity)) {
      fit = i;
    }
    if (largest < 0 || s.capacity > slots_[static_cast<size_t>(largest)].capacity) largest = i;
  }
  Grant g;
  if (fit >= 0) {
    g.slot = fit;
    g.capacity = g.old_capacity = slots_[static_cast<size_t>(fit)].capacity;
  } else if (largest >= 0) {
    g.slot = largest;
    g.old_capacity = slots_[static_cast<size_t>(largest)].capacity;
    g.capacity = want;
    g.allocate = true;
  } else {
    slots_.push_back({});
    g.slot = slots() - 1;
    g.capacity = want;
    g.allocate = true;
  }
  Slot& s = slots_[static_cast<size_t>(g.slot)];
  s.capacity = g.capacity;
  s.in_use = true;
  return g;
}

void StagingPool::Release(int slot) {
  if (slot >= 0 && slot < slots()) slots_[static_cast<size_t>(slot)].in_use = false;
}

size_t StagingPool::total_bytes() const {
  size_t n = 0;
  for (const Slot& s : slots_) n += s.capacity;
  return n;
}

}  // namespace moerun
